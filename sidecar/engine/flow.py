"""Backpressure for the protocol-level engine: why a transport's reading is paused.

Reading from one side pauses when the other side cannot take more (its transport's write buffer
went above the high-water mark: ``pause_writing``) and resumes when that buffer drained below the
low-water mark (``resume_writing``), as in uvicorn's ``flow_control.py``. A connection can be
paused for several independent reasons at once (the peer is full, a pipelined request waits its
turn, no upstream connection yet); each reason is a bit and reading resumes only when none is
left, so one reason clearing never un-pauses another.
"""

from __future__ import annotations

import asyncio

# Reasons to stop reading a client connection.
PEER_FULL = 1  # the upstream connection's write buffer is above its high-water mark
PIPELINED = 2  # a later request is parsed and waits for the current response
WAITING = 4  # the request body is buffered while no upstream connection is attached yet
STOPPED = 8  # the request stream is unusable (parse error, upgrade): read nothing more

# Reasons to stop reading an upstream connection (through its transport).
CLIENT_FULL = 1  # the client connection's write buffer is above its high-water mark
DIRECT = 2  # its body is read by sidecar.engine.direct.DirectReads instead


class ReadFlow:
    """Pause/resume a transport's reading by reason bits."""

    __slots__ = ("transport", "reasons")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport
        self.reasons = 0

    def pause(self, reason: int) -> None:
        if not self.reasons and not self.transport.is_closing():
            self.transport.pause_reading()
        self.reasons |= reason

    def resume(self, reason: int) -> None:
        if self.reasons & reason:
            self.reasons &= ~reason
            if not self.reasons and not self.transport.is_closing():
                self.transport.resume_reading()

    def clear(self) -> None:
        """Drop every reason and read again (an upstream connection going back to the pool)."""
        if self.reasons:
            self.reasons = 0
            if not self.transport.is_closing():
                self.transport.resume_reading()
