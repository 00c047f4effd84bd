"""Direct socket I/O for streamed response bodies: what an event costs beyond its two syscalls.

A token stream is a long trickle of small reads; through the loop's transports each costs a
wakeup of the loop, an allocation, a few Python calls and the transport's write machinery on
both sides, several times what a proxy in C spends on it. The compiled build
(:mod:`sidecar.engine._direct_socket`, :mod:`sidecar.engine._direct_reads`) cuts that:

- bytes for a client, and a request's bytes for a plain-TCP upstream, go out with one ``send``
  whenever the transport has nothing buffered (:class:`DirectSocket`, used by
  :class:`~sidecar.engine.relay.ClientOutput` and the upstream connections, each its
  transport's only writer): the transport takes the rest, or everything after an error, so
  backpressure and errors work as before;
- an upstream connection whose response body is still going after its first read
  (:data:`ENROLL_AFTER`) is enrolled in :class:`DirectReads`: its transport stops reading, and a thread of the engine's
  own, with no Python state, relays it: it reads the upstream's socket and sends each read that
  the relay would pass through unchanged (the usual token event) straight to the client's
  socket, without waking the event loop; the read that ends the body the usual way too, after
  which the connection is handed back to the loop to end the response. Every other read
  (trailers, bytes after the body, framing the thread does not follow) is handed back to the
  loop and fed to the response's :class:`~sidecar.engine.relay.BodyRelay` as a transport's read
  is. The connection also goes back to its transport when the client's socket fills (its reads
  then pause as always) and when its socket has anything but bytes (a close or an error: the
  transport, reading again, meets it and reports it as it always does).

Plain-TCP sockets only: a TLS upstream's bytes are records its transport must decrypt. In the
pure-Python build both names are None and everything goes through the transports.
"""

from __future__ import annotations

try:
    from sidecar.engine._direct_reads import DirectReads
    from sidecar.engine._direct_socket import DirectSocket
except ImportError:  # the pure-Python build
    DirectReads = DirectSocket = None

# Reads of one response body through the transport before its connection is enrolled: the
# first (often with the head), so a body that ends within it (most answers that are not
# streams) never pays what enrolling and leaving cost (two dups, two epoll changes, a hand-back
# at the end); a stream's events after it never wake the event loop.
ENROLL_AFTER = 1
