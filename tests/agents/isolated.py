"""Run one agent client where it can reach nothing but loopback, recording every address it tries.

``python -m tests.agents.isolated --port PORT --socket PATH --trace LOG --cwd DIR [--netns] -- ARGV...``

- ``--netns``: this process runs in a network namespace of its own (``unshare -n``), which has
  nothing but a loopback interface: it brings that up, so the client cannot reach anything else.
- On ``127.0.0.1:PORT`` it relays every connection to the Unix socket ``PATH`` (a file path,
  which crosses network namespaces), where the test's end listens: the only way out.
- The client runs under ``strace -f``: every ``connect``, ``sendto`` and ``sendmsg`` it makes,
  with its address, goes to ``LOG`` (:func:`tried_addresses` reads it back).

Exits with the client's status; the client's output goes to this process's.
"""

from __future__ import annotations

import argparse
import asyncio
import fcntl
import re
import shutil
import socket
import struct
import sys
from pathlib import Path

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def loopback_up() -> None:
    """Bring ``lo`` up (a new network namespace has it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        request = struct.pack("16sh", b"lo", 0)
        flags = struct.unpack("16sh", fcntl.ioctl(s, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh", b"lo", flags | IFF_UP))


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until it ends, then close ``writer``."""
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


async def run(port: int, path: str, trace: str, argv: list[str], cwd: str) -> int:
    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_unix_connection(path)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(relay, "127.0.0.1", port)
    strace = shutil.which("strace")
    assert strace is not None, "strace is needed to record what the client tries to reach"
    command = [strace, "-f", "-qq", "-e", "trace=connect,sendto,sendmsg", "-e", "signal=none", "-o", trace, *argv]
    proc = await asyncio.create_subprocess_exec(*command, stdin=asyncio.subprocess.DEVNULL, cwd=cwd)
    try:
        return await proc.wait()
    finally:
        server.close()


# connect(3, {sa_family=AF_INET, sin_port=htons(443), sin_addr=inet_addr("1.2.3.4")}, 16)
# connect(3, {sa_family=AF_INET6, sin6_port=htons(443), ..., inet_pton(AF_INET6, "::1", &sin6_addr), ...}, 28)
_INET = re.compile(r'sin_addr=inet_addr\("([^"]+)"\)')
_INET6 = re.compile(r'inet_pton\(AF_INET6, "([^"]+)"')


def tried_addresses(log: Path) -> list[str]:
    """Every IPv4 and IPv6 address the traced process tried to reach (connect, sendto, sendmsg)."""
    found: list[str] = []
    for line in log.read_text(errors="replace").splitlines():
        found += _INET.findall(line) + _INET6.findall(line)
    return found


def is_loopback(address: str) -> bool:
    return address.startswith("127.") or address in ("::1", "::ffff:127.0.0.1")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--socket", required=True)
    parser.add_argument("--trace", required=True)
    parser.add_argument("--netns", action="store_true")
    parser.add_argument("--cwd", required=True)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    if args.netns:
        loopback_up()
    return asyncio.run(run(args.port, args.socket, args.trace, argv, args.cwd))


if __name__ == "__main__":
    sys.exit(main())
