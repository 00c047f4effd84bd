"""The process's open file limit, raised at start.

A proxy holds two sockets per request in flight, and the fast engine's stream thread two more
descriptors per stream it relays (:mod:`sidecar.engine._direct_reads`). Many environments start
processes with a soft limit of 1024 under a far higher hard limit; the soft limit is the
process's to raise, as servers written in Go do at start.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger("sidecar")

# Never asks for more than this (a hard limit of "unlimited" is not a number of descriptors).
CEILING = 1 << 20


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (at most :data:`CEILING`); return the
    soft limit before and after (equal when there was nothing to raise or it was refused)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = CEILING if hard == resource.RLIM_INFINITY or hard > CEILING else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as exc:
            log.warning("open file limit stays %d: raising it to %d failed: %s", soft, want, exc)
            return soft, soft
        log.info("open file limit raised from %d to %d", soft, want)
        return soft, want
    return soft, soft
