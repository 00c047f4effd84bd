"""The fast engine's exchange phases, how an exchange's end leaves its client connection, and
a client connection's lifecycle: a plain module, whose importers read them as C integers when
compiled (docs/architecture.md, "Compiled and pure-Python builds")."""

from __future__ import annotations

# Exchange phases, in order. QUEUED: parsed, waiting its turn (not counted in flight yet);
# LOADING: its session is being loaded from the shared store before routing; BUFFERING: started
# (routing, or reading the body a mode needs); TRANSFORMING: the router's body work runs on a
# worker thread; CONNECTING: waiting for an upstream connection; SENDING: the body streams to
# the upstream; SENT: the whole request went out; DONE: retired (see Exchange._retire). The response
# runs beside SENDING / SENT: it has begun once ``resp_status`` is set.
QUEUED, LOADING, BUFFERING, TRANSFORMING, CONNECTING, SENDING, SENT, DONE = range(8)
# How an exchange's end leaves its client connection (ClientBase.retired).
KEEP, CLOSE, ABORT = range(3)
# A client connection's lifecycle. READING: requests are read and answered in order; ANSWERING:
# no more are read (one was refused: the stream cannot be trusted after it), those queued are
# answered, then it closes; CLOSED: closing or gone, nothing is read, written or timed.
READING, ANSWERING, CLOSED = range(3)
