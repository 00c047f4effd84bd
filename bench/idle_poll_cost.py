"""What idle polling costs: CPU of an event loop fed synthetic I/O events, polling off and on.

    python bench/idle_poll_cost.py [--duration 3] [--out-dir bench/results]

A sender process on core 1 writes one byte to a socket pair at random (exponential) gaps; the
event loop on core 0 (uvloop) reads them, and each read calls the fast engine's
:class:`sidecar.engine.idle_poll.IdlePoller` and then busy-works for a fixed time, like a request.
For each traffic shape the loop runs with ``idle_poll_us`` 0 and with a typical opted-in window
(200), and the table shows the loop thread's CPU time over wall time, next to the share its work alone needs.
Run it alone on the machine (like ``proxy_bench.py``); it binds no port. Every run writes
bench/results/<date>-idle_poll_cost-<commit>.md and .json (bench/record.py).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import random
import socket
import sys
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import record  # noqa: E402

from sidecar.engine.idle_poll import IdlePoller  # noqa: E402

# A typical opted-in window (the setting's default is 0: off).
WINDOW_US = 200

LOOP_CPU, SENDER_CPU = 0, 1
# (mean gap between events in us, work per event in us, what it stands for)
SHAPES = [
    (2000, 15, "sparse: a few streams, a token every few ms"),
    (1000, 15, "tokens of a few dozen streams"),
    (150, 15, "tokens of hundreds of streams"),
    (300, 60, "requests at moderate load"),
    (100, 40, "requests near saturation"),
]
END = b"q"


def spin(seconds: float) -> None:
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def send(sock: socket.socket, mean_gap: float, duration: float) -> None:
    os.sched_setaffinity(0, {SENDER_CPU})
    end = time.perf_counter() + duration
    while time.perf_counter() < end:
        spin(random.expovariate(1 / mean_gap))  # a busy wait: sleeping is too coarse for these gaps
        sock.send(b"x")
    sock.send(END)


class Reader(asyncio.Protocol):
    def __init__(self, poller: IdlePoller, work: float, done: asyncio.Future[None]) -> None:
        self.poller, self.work, self.done, self.events = poller, work, done, 0

    def data_received(self, data: bytes) -> None:
        self.poller.note()
        spin(self.work * len(data))
        self.events += len(data)
        if END in data and not self.done.done():
            self.done.set_result(None)


async def measure(sock: socket.socket, work: float, window: float) -> tuple[float, float, float]:
    """(loop CPU share, work share, polled share) until the sender's end byte."""
    loop = asyncio.get_running_loop()
    poller = IdlePoller(loop, window)
    done: asyncio.Future[None] = loop.create_future()
    transport, reader = await loop.create_connection(lambda: Reader(poller, work, done), sock=sock)
    cpu0, wall0 = time.thread_time(), time.perf_counter()
    await done
    cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
    poller.stop()
    transport.close()
    return cpu / wall, reader.events * work / wall, poller.polled_seconds() / wall


def run(mean_gap_us: float, work_us: float, window_us: float, duration: float) -> tuple[float, float, float]:
    ours, theirs = socket.socketpair()
    sender = multiprocessing.Process(target=send, args=(theirs, mean_gap_us * 1e-6, duration))
    sender.start()
    try:
        return uvloop.run(measure(ours, work_us * 1e-6, window_us * 1e-6))
    finally:
        sender.join()
        theirs.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3.0, help="seconds per measurement (default 3)")
    p.add_argument(
        "--out-dir", type=Path, default=record.RESULTS, help="where the dated .md and .json go (default bench/results)"
    )
    args = p.parse_args()
    facts = record.machine_facts(wake_cores=(LOOP_CPU, SENDER_CPU))
    os.sched_setaffinity(0, {LOOP_CPU})
    lines = [
        f"| traffic | mean gap | work per event | work share | loop CPU, polling off | "
        f"loop CPU, idle_poll_us {WINDOW_US} | time polled (work included) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines))
    rows = []
    for gap, work, what in SHAPES:
        off, share, _ = run(gap, work, 0, args.duration)
        on, _, polled = run(gap, work, WINDOW_US, args.duration)
        rows.append(
            {
                "traffic": what,
                "mean_gap_us": gap,
                "work_us": work,
                "work_share": share,
                "loop_cpu_polling_off": off,
                "loop_cpu_polling_on": on,
                "polled_share": polled,
            }
        )
        lines.append(f"| {what} | {gap} us | {work} us | {share:.0%} | {off:.0%} | {on:.0%} | {polled:.0%} |")
        print(lines[-1], flush=True)
    body = "\n".join(
        [
            f"Loop on core {LOOP_CPU}, sender on core {SENDER_CPU}, {args.duration:g} s per "
            "measurement; loop thread CPU time over wall time.",
            "",
            *lines,
        ]
    )
    raw = {"args": {"duration": args.duration}, "idle_poll_us": WINDOW_US, "rows": rows}
    md, js = record.write("idle_poll_cost", f"Idle polling cost, {facts['date'][:10]}", body, raw, facts, args.out_dir)
    print(f"written: {md}, {js}", file=sys.stderr)


if __name__ == "__main__":
    main()
