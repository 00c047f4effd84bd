"""Load side of the streaming cases: the paced upstream and the stream driver, in one process.

    python bench/stream_load.py --upstream-port PORT --control-port PORT

bench/proxy_bench.py starts this pinned to the load core. It serves the paced SSE upstream
(bench/sse_upstream.py) on ``--upstream-port`` and, on ``--control-port``, takes one JSON object
per line naming a run and answers one JSON line with its results. Upstream and driver share one
event loop on purpose: as two processes on one core, each would wait for the scheduler to switch
to it (milliseconds under load), which would show up as pacing jitter and time to first event.

A run (keys: ``port``, ``streams``, ``events``, ``gap_us``, ``bytes``, ``waves``, ``cpu_pids``,
``timeout``) opens ``streams`` connections to 127.0.0.1:``port`` (a proxy, or the upstream
itself) and on each runs one warm-up stream of 2 short events, so that every connection, and
the proxy's connection to the upstream behind it, is warm before anything is measured. Then
each connection sends one ``GET /v1/stream?...`` with its own ``X-Correlation-ID``, the requests
spread evenly over one pacing gap, as streams that began at different times would be; and as
soon as a stream ends its connection starts the next, ``waves`` streams in all (default 1). So
the first wave's requests arrive while the streams are starting, and every later one while the
other streams are in full flow, as new requests do in steady traffic. Every
received byte chunk is timestamped on arrival (time.perf_counter_ns, before parsing), and each
event completed by a chunk gets the chunk's time:

- time to first event: from just after the request's last byte was written to the arrival of
  the chunk carrying the response's first body byte;
- inter-event gaps: between consecutive events of one stream (events that arrive in the same
  chunk have gap 0).

Over the measured interval (first measured request to last event) it reads the CPU time of the
``cpu_pids`` processes (the proxy) from the scheduler's per-thread run time
(/proc/<pid>/task/*/schedstat, in nanoseconds: the counter that /proc/<pid>/stat's utime + stime
are derived from, there rounded to 10 ms ticks; both are reported), and its own CPU time (the
upstream and the driver together: near 100%, the load side was the limit). Beside each, the time
their threads were runnable but waited for the core: what other processes took from them. The
proxy's figures are also given per thread kind (``proxy_threads``: each process's main thread, and
the other threads by name): the sidecar's event loop, which starts every stream, and its stream
thread, which relays the events.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

from sse_upstream import HOST, Server, TimerFd  # noqa: E402

PATH = "/v1/stream"
SESSION_HEADER = b"X-Correlation-ID"
CONNECT_BATCH = 64  # connections opened at once: keeps a 1000-stream start within listen backlogs
WARMUP_EVENTS = 2
WARMUP_GAP_US = 1000
NOT_STARTED = "not started: an earlier stream on its connection failed"


def sched_ns(pids: list[int]) -> tuple[int, int]:
    """(time on a CPU, time runnable but waiting for a CPU) so far of the live threads of the
    processes ``pids``, in ns. The wait is the time other processes took the core from them."""
    return totals(sched_by_thread(pids))


def totals(threads: dict[str, list[int]]) -> tuple[int, int]:
    """The sums over the threads of a :func:`sched_by_thread` reading."""
    return sum(run for run, _ in threads.values()), sum(wait for _, wait in threads.values())


def sched_by_thread(pids: list[int]) -> dict[str, list[int]]:
    """:func:`sched_ns` per thread kind of the processes ``pids``: ``main`` (each process's first
    thread: an event loop, for the sidecar) and the other threads by name (the sidecar's stream
    thread is ``sidecar-streams``), each [time on a CPU, time runnable but waiting], in ns."""
    out: dict[str, list[int]] = {}
    for pid in pids:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # the process is gone
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", "rb") as f:
                    fields = f.read().split()
                name = "main" if tid == str(pid) else Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                sums = out.setdefault(name, [0, 0])
                sums[0] += int(fields[0])
                sums[1] += int(fields[1])
            except (OSError, ValueError, IndexError):
                continue  # the thread ended meanwhile
    return out


def stat_cpu_ns(pid: int) -> int:
    """utime + stime of process ``pid`` from /proc/<pid>/stat, in ns (10 ms resolution)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: list[int], q: float) -> float | None:
    """The q-quantile (nearest rank) of sorted nanosecond values, in ms; None when empty."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))] / 1e6


class StreamClient(asyncio.Protocol):
    """One keep-alive connection; runs one stream at a time and records its timings in the
    driver."""

    def __init__(self, driver: Driver, index: int) -> None:
        self.driver = driver
        self.session = f"00000000-strm-4000-8000-{index:012d}".encode()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.measuring = False
        self.done: asyncio.Future[None] | None = None
        self.sent_at = 0
        self.now = 0
        self.first_body = True
        self.started = 0  # measured streams started on this connection
        self.events = 0
        self.last_event = 0
        self.nl_tail = False
        self.status = 0
        self.error = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._finish(f"connection closed ({exc or 'EOF'})")

    def request(self, query: bytes, measuring: bool) -> asyncio.Future[None]:
        self.done = asyncio.get_running_loop().create_future()
        self.started += measuring
        self.measuring = measuring
        self.first_body = True
        self.events = 0
        self.nl_tail = False
        self.status = 0
        self.error = ""
        if self.transport is None or self.transport.is_closing():
            self._finish("connection closed before the request")
            return self.done
        self.transport.write(
            b"GET %s?%s HTTP/1.1\r\nHost: bench\r\n%s: %s\r\nAccept: text/event-stream\r\n\r\n"
            % (PATH.encode(), query, SESSION_HEADER, self.session)
        )
        self.sent_at = time.perf_counter_ns()
        return self.done

    def data_received(self, data: bytes) -> None:
        self.now = time.perf_counter_ns()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(f"bad response: {exc}")
            if self.transport:
                self.transport.close()

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        now = self.now
        if self.first_body:
            self.first_body = False
            if self.measuring:
                self.driver.ttft.append(now - self.sent_at)
                if self.started > 1:
                    self.driver.ttft_later.append(now - self.sent_at)
        # An event ends with a blank line; "\n\n" never occurs inside one, but may be split
        # between two chunks.
        completed = body.count(b"\n\n")
        joined = self.nl_tail and body[:1] == b"\n"
        if joined:
            completed += 1
        self.nl_tail = body[-1:] == b"\n" and body[-2:] != b"\n\n" and not (joined and len(body) == 1)
        if not completed:
            return
        if self.measuring:
            gaps = self.driver.gaps
            if self.events:
                gaps.append(now - self.last_event)
            if completed > 1:
                gaps.extend([0] * (completed - 1))
            self.driver.delivered += completed
        self.events += completed
        self.last_event = now

    def on_message_complete(self) -> None:
        self._finish("" if self.status == 200 else f"status {self.status}")

    def _finish(self, error: str) -> None:
        if self.done is not None and not self.done.done():
            self.error = error
            self.done.set_result(None)


class Driver:
    """One run: ``streams`` warm connections, ``waves`` measured streams each, back to back."""

    def __init__(self, upstream: Server, spec: dict[str, Any]) -> None:
        self.upstream = upstream
        self.port = int(spec["port"])
        self.streams = int(spec["streams"])
        self.events = int(spec["events"])
        self.gap_us = int(spec["gap_us"])
        self.bytes = int(spec["bytes"])
        self.cpu_pids = [int(p) for p in spec.get("cpu_pids", [])]
        self.waves = int(spec.get("waves", 1))
        self.timeout = float(spec.get("timeout", 30))
        self.ttft: list[int] = []
        self.ttft_later: list[int] = []  # of the waves after the first
        self.start_lateness: list[int] = []  # of the first wave's requests, against their moments
        self.gaps: list[int] = []
        self.delivered = 0

    async def connect(self) -> list[StreamClient]:
        loop = asyncio.get_running_loop()
        clients: list[StreamClient] = []
        for start in range(0, self.streams, CONNECT_BATCH):
            batch = [StreamClient(self, i) for i in range(start, min(self.streams, start + CONNECT_BATCH))]
            await asyncio.gather(
                *(
                    loop.create_connection(lambda c=c: c, HOST, self.port)  # type: ignore[misc]
                    for c in batch
                )
            )
            clients += batch
        return clients

    async def run(self) -> dict[str, Any]:
        clients = await self.connect()
        try:
            return await self._measure(clients)
        finally:
            for c in clients:
                if c.transport:
                    c.transport.close()

    async def _streams(self, c: StreamClient, query: bytes, errors: dict[str, int]) -> None:
        """``waves`` measured streams on ``c``, each sent as soon as the last ended; the first that
        fails ends them, and those not started count as errors too (a timeout is counted by the
        caller)."""
        for wave in range(self.waves):
            await c.request(query, True)
            reason = c.error or ("" if c.events == self.events else f"{c.events} of {self.events} events")
            if reason:
                errors[reason] = errors.get(reason, 0) + 1
                if left := self.waves - wave - 1:
                    errors[NOT_STARTED] = errors.get(NOT_STARTED, 0) + left
                return

    async def _start_spread(
        self, clients: list[StreamClient], query: bytes, errors: dict[str, int]
    ) -> list[asyncio.Task[None]]:
        """Start each connection's streams (:meth:`_streams`) at a moment of its own, spread evenly
        over one pacing gap, timed by a timerfd: the loop's own timers round to milliseconds and
        would send the requests in clumps (at 200 streams, 10 at once every millisecond), so that
        each clump's last request waited for the proxy to handle the others first."""
        loop = asyncio.get_running_loop()
        timer = TimerFd()
        tasks: list[asyncio.Task[None]] = []
        started = loop.create_future()
        step = self.gap_us * 1000 // len(clients)
        start = time.monotonic_ns()

        def fire() -> None:
            timer.clear()
            now = time.monotonic_ns()
            while len(tasks) < len(clients) and start + len(tasks) * step <= now:
                self.start_lateness.append(now - start - len(tasks) * step)
                tasks.append(loop.create_task(self._streams(clients[len(tasks)], query, errors)))
            if len(tasks) < len(clients):
                timer.arm(start + len(tasks) * step)
            elif not started.done():
                started.set_result(None)

        loop.add_reader(timer.fd, fire)
        try:
            timer.arm(start)
            await started
        finally:
            loop.remove_reader(timer.fd)
            os.close(timer.fd)
        return tasks

    async def _measure(self, clients: list[StreamClient]) -> dict[str, Any]:
        warm = f"events={WARMUP_EVENTS}&gap_us={WARMUP_GAP_US}&bytes={self.bytes}".encode()
        await asyncio.wait_for(asyncio.gather(*(c.request(warm, False) for c in clients)), self.timeout)
        warm_errors = sum(1 for c in clients if c.error or c.events != WARMUP_EVENTS)
        query = f"events={self.events}&gap_us={self.gap_us}&bytes={self.bytes}".encode()
        self.upstream.pacer.take_stats()  # lateness counts from here

        pids, me = self.cpu_pids, [os.getpid()]
        threads0 = sched_by_thread(pids)
        proxy0, proxy_wait0 = totals(threads0)
        proxy_stat0 = sum(stat_cpu_ns(p) for p in pids)
        self0, self_wait0 = sched_ns(me)
        t0 = time.perf_counter_ns()
        errors: dict[str, int] = {}
        tasks = await self._start_spread(clients, query, errors)
        nominal = self.waves * self.events * self.gap_us * 1e-6
        _, pending = await asyncio.wait(tasks, timeout=self.timeout + 2 * nominal)
        for task in pending:
            task.cancel()
        t1 = time.perf_counter_ns()
        threads1 = sched_by_thread(pids)
        proxy1, proxy_wait1 = totals(threads1)
        proxy_stat1 = sum(stat_cpu_ns(p) for p in pids)
        self1, self_wait1 = sched_ns(me)
        pacing = self.upstream.pacer.take_stats()

        for c, task in zip(clients, tasks, strict=True):
            if task in pending:  # its stream in flight timed out; the waves after it never started
                errors["timeout"] = errors.get("timeout", 0) + 1
                if left := self.waves - c.started:
                    errors[NOT_STARTED] = errors.get(NOT_STARTED, 0) + left
        seconds = (t1 - t0) / 1e9
        ttft, later, gaps = sorted(self.ttft), sorted(self.ttft_later), sorted(self.gaps)
        return {
            "streams": len(clients),
            "waves": self.waves,
            "events_expected": len(clients) * self.events * self.waves,
            "events": self.delivered,
            "errors": sum(errors.values()),
            "error_reasons": errors,
            "warmup_errors": warm_errors,
            "timed_out": len(pending),
            "seconds": round(seconds, 4),
            "ttft_p50_ms": percentile(ttft, 0.5),
            "ttft_p99_ms": percentile(ttft, 0.99),
            "ttft_max_ms": percentile(ttft, 1.0),
            "ttft_samples": len(ttft),
            "ttft_later_p50_ms": percentile(later, 0.5),
            "ttft_later_p99_ms": percentile(later, 0.99),
            "start_late_max_ms": max(self.start_lateness, default=0) / 1e6,
            "gap_p50_ms": percentile(gaps, 0.5),
            "gap_p99_ms": percentile(gaps, 0.99),
            "gap_p999_ms": percentile(gaps, 0.999),
            "gap_max_ms": percentile(gaps, 1.0),
            "gap_samples": len(gaps),
            "proxy_cpu_s": (proxy1 - proxy0) / 1e9 if pids else None,
            "proxy_stat_cpu_s": (proxy_stat1 - proxy_stat0) / 1e9 if pids else None,
            "proxy_wait_s": (proxy_wait1 - proxy_wait0) / 1e9 if pids else None,
            "proxy_threads": {
                name: {
                    "cpu_s": (run - threads0.get(name, [0, 0])[0]) / 1e9,
                    "wait_s": (wait - threads0.get(name, [0, 0])[1]) / 1e9,
                }
                for name, (run, wait) in threads1.items()
            },
            "load_cpu_s": (self1 - self0) / 1e9,
            "load_wait_s": (self_wait1 - self_wait0) / 1e9,
            "upstream_pacing": pacing,
        }


async def serve(upstream_port: int, control_port: int) -> None:
    upstream = Server()
    await upstream.start(upstream_port)
    busy = asyncio.Lock()  # one run at a time: runs measure the whole process's CPU

    async def control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                spec = json.loads(line)
                if spec.get("ping"):
                    reply: dict[str, Any] = {"ok": True, "pid": os.getpid()}
                else:
                    async with busy:
                        gc.collect()
                        gc.disable()  # no collection pauses inside a measured interval
                        try:
                            reply = await Driver(upstream, spec).run()
                        except (TimeoutError, OSError) as exc:
                            reply = {"fatal": f"{type(exc).__name__}: {exc}"}
                        finally:
                            gc.enable()
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        finally:
            writer.close()

    controller = await asyncio.start_server(control, HOST, control_port)
    stop = asyncio.get_running_loop().create_future()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set_result, None)
    async with controller:
        await stop


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--upstream-port", type=int, required=True)
    p.add_argument("--control-port", type=int, required=True)
    args = p.parse_args()
    uvloop.run(serve(args.upstream_port, args.control_port))


if __name__ == "__main__":
    main()
