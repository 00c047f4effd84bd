"""The end of a streamed final turn that its client read whole and closed at once, on both
engines and builds: the session ends ``final_turn_completed`` and the request is counted, however
the client's close races the end of the response in the sidecar.

The compiled fast engine's stream thread sends a long body's end itself, then hands the
connection back to the event loop to end the response; a client that closes as soon as it has
the last byte (``curl``) can be seen closing before that hand-back. Its clients here are a
process of their own (:mod:`tests.direct.oneshot_clients`), and two busy loops load the cores
for the duration, which widens the race as a loaded machine does.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from tests.engine import Handler, RawMessage
from tests.waiting import eventually, wait_for

CLIENTS = Path(__file__).with_name("oneshot_clients.py")
TURNS = 40  # final turns, each its own session
EVENTS = 8

SSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"


def event(i: int) -> bytes:
    return b'data: {"i":%d,"delta":"tok"}\n\n' % i


@contextlib.contextmanager
def busy_cores(n: int = 2) -> Iterator[None]:
    """``n`` processes spinning on a core each, for the duration (stopped by their PIDs)."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def final_stream(sidecar: Callable[[], Any], chunked: bool) -> Handler:
    """An SSE stream of EVENTS events: the head and the first event in one write, the rest (the
    body's end included) once the stream thread of ``sidecar()``'s engine relays the body,
    where there is one (the compiled fast engine)."""
    if chunked:
        parts = [b"%x\r\n%s\r\n" % (len(event(i)), event(i)) for i in range(EVENTS)]
        parts[-1] += b"0\r\n\r\n"
        head = SSE + b"Transfer-Encoding: chunked\r\n\r\n"
    else:
        parts = [event(i) for i in range(EVENTS)]
        head = SSE + b"Content-Length: %d\r\n\r\n" % sum(map(len, parts))

    async def handle(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        direct = getattr(sidecar().engine, "direct", None)
        enrolled = direct.enrolled if direct is not None else 0
        writer.write(head + parts[0])
        await writer.drain()
        if direct is not None:
            await wait_for(lambda: direct.enrolled > enrolled)
        for part in parts[1:]:
            writer.write(part)
            await writer.drain()
        return True

    return handle


async def metrics(sc: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the sidecar's ``/metrics``: (name, sorted labels) -> value."""
    async with aiohttp.ClientSession() as s, s.get(f"{sc.admin_url}/metrics") as r:
        assert r.status == 200
        text = await r.text()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def ended(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    """Sessions ended so far, by reason."""
    return {
        dict(labels)["reason"]: value
        for (name, labels), value in samples.items()
        if name == "sidecar_sessions_ended_total" and value
    }


def total(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return sum(value for (n, have), value in samples.items() if n == name and labels.items() <= dict(have).items())


async def test_final_turns_read_whole_and_closed_at_once_are_completed(
    raw_upstream: Any, start_sidecar: Any, engine: str
) -> None:
    """TURNS one-shot clients under CPU load, streams chunked and by length, closing by a FIN
    and by a reset: every session ends ``final_turn_completed``, every request is counted."""
    started: list[Any] = []
    up = await raw_upstream(
        {
            "/chunked": final_stream(lambda: started[0], chunked=True),
            "/length": final_stream(lambda: started[0], chunked=False),
        }
    )
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False)
    started.append(sc)
    with busy_cores():
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            str(CLIENTS),
            str(sc.engine.port),
            "final",
            str(TURNS),
            "/chunked",
            "/length",
            stdout=asyncio.subprocess.PIPE,
        )
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0
    # Every client got its whole body (a 200 read to its last byte) before closing.
    assert [line.split()[1:] for line in out.decode().splitlines()] == [["200", "1"]] * TURNS
    samples = await eventually(lambda: metrics(sc), lambda got: sum(ended(got).values()) >= TURNS)
    assert ended(samples) == {"final_turn_completed": TURNS}
    assert total(samples, "sidecar_requests_total", status_class="2xx") == TURNS
    assert total(samples, "sidecar_request_duration_seconds_count") == TURNS
    if getattr(sc.engine, "direct", None) is not None:
        assert sc.engine.direct.enrolled == TURNS  # every body was relayed by the stream thread
