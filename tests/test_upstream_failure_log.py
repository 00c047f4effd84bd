"""Upstream failures explain themselves in the log: one WARNING line per (deployment, upstream,
kind, reason) at once, then at most one per interval carrying the count of the ones not logged;
never a credential, header value or body."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import aiohttp
import pytest

from sidecar.deployments import Upstream
from sidecar.errors import ConfigError
from sidecar.upstream_failures import UpstreamFailureLog
from tests.engine import RawMessage
from tests.proxy.test_errors import free_port

LOGGER = "sidecar.upstream"
SECRET_HEADER = {"X-Api-Key": "hunter2-header-value"}


def lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER]


def fields(record: logging.LogRecord) -> dict[str, Any]:
    keys = ("deployment", "upstream", "upstream_index", "kind", "reason", "suppressed")
    return {k: getattr(record, k) for k in keys if hasattr(record, k)}


def everything_logged(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)


async def until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_first_line_at_once_then_one_per_interval_with_the_count(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    flog = UpstreamFailureLog(interval=0.2)
    up = Upstream.parse("http://user:pw-secret@127.0.0.1:9/v1", 1)
    for _ in range(6):
        flog.record("chat", up, "connect", "connection refused")
    assert [fields(r) for r in lines(caplog)] == [
        {
            "deployment": "chat",
            "upstream": "http://127.0.0.1:9/v1",
            "upstream_index": 1,
            "kind": "connect",
            "reason": "connection refused",
        }
    ]
    assert lines(caplog)[0].levelno == logging.WARNING
    assert lines(caplog)[0].getMessage() == "upstream failed: connection refused"
    # The end of the interval carries the five that were only counted.
    await until(lambda: len(lines(caplog)) == 2)
    assert fields(lines(caplog)[1])["suppressed"] == 5
    assert "5 more like it" in lines(caplog)[1].getMessage()
    # A quiet interval forgets the group: the next failure is logged at once again.
    await until(lambda: flog.groups == 0)
    flog.record("chat", up, "connect", "connection refused")
    assert len(lines(caplog)) == 3 and "suppressed" not in fields(lines(caplog)[2])
    # Another reason (or kind, or upstream) is another group, logged at once.
    flog.record("chat", up, "connect", "TLS: CERTIFICATE_VERIFY_FAILED")
    assert fields(lines(caplog)[3])["reason"] == "TLS: CERTIFICATE_VERIFY_FAILED"
    flog.close()
    assert "pw-secret" not in everything_logged(caplog)


async def test_state_is_bounded_and_no_count_is_lost(caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    flog = UpstreamFailureLog(interval=60.0, max_groups=4)
    up = Upstream.parse("http://127.0.0.1:9", 0)
    for i in range(20):
        for _ in range(3):
            flog.record("chat", up, "protocol", f"reason {i}")
        assert flog.groups <= 4
    flog.close()
    assert flog.groups == 0
    # Every failure is in a line, logged or counted: a group pushed out says what it had counted.
    assert sum(fields(r).get("suppressed", 1) for r in lines(caplog)) == 60
    assert len(lines(caplog)) == 40


async def test_unreachable_upstream_is_logged_once_per_interval(start_sidecar, caplog):
    caplog.set_level(logging.INFO)
    port = free_port()
    sc = await start_sidecar(upstream=f"http://operator:pw-secret@127.0.0.1:{port}", mode="dynamo_headers")
    async with aiohttp.ClientSession() as s:
        for i in range(20):
            async with s.post(
                f"{sc.proxy_url}/v1/chat/completions",
                data=b'{"secret-body": 1}',
                headers={**SECRET_HEADER, "X-Correlation-ID": f"s{i}"},
            ) as resp:
                assert resp.status == 502
    (line,) = lines(caplog)
    assert fields(line) == {
        "deployment": "default",
        "upstream": f"http://127.0.0.1:{port}",
        "upstream_index": 0,
        "kind": "connect",
        "reason": "connection refused",
    }
    await sc.stop()  # what was counted is logged at shutdown
    assert fields(lines(caplog)[-1])["suppressed"] == 19
    logged = everything_logged(caplog)
    assert "pw-secret" not in logged and "hunter2" not in logged and "secret-body" not in logged


async def test_timeouts_and_resets_say_which(raw_upstream, start_sidecar, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def silent(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        await asyncio.sleep(30)
        return False

    async def cut(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n0123456789")
        await writer.drain()
        return False  # closes with 90 bytes missing

    up = await raw_upstream({"/silent": silent, "/cut": cut})
    sc = await start_sidecar(upstream=up.url, mode="dynamo_headers", timeouts={"first_byte": 0.3})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/silent", headers=SECRET_HEADER) as resp:
            assert resp.status == 504
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.get(f"{sc.proxy_url}/cut", headers=SECRET_HEADER) as resp:
                await resp.read()
    await until(lambda: len(lines(caplog)) == 2)
    timeout, reset = (fields(r) for r in lines(caplog))
    assert (timeout["kind"], timeout["reason"]) == ("timeout", "no response within 0.3 s")
    assert reset["kind"] == "reset" and reset["reason"].startswith("mid-response: "), reset
    assert "hunter2" not in everything_logged(caplog)
    # Those lines say it all: no error line (with a traceback) per failed request besides them.
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def test_tls_handshake_failure_names_the_tls_reason(start_sidecar, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)

    async def plain_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")  # to a TLS ClientHello
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(plain_http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        try:
            sc = await start_sidecar(upstream=f"https://127.0.0.1:{port}", mode="dynamo_headers")
        except ConfigError as exc:
            pytest.skip(f"this engine has no https upstreams: {exc}")
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{sc.proxy_url}/x") as resp:
                assert resp.status == 502
                assert ": TLS: " in (await resp.json())["error"]["message"]
        (line,) = lines(caplog)
        assert fields(line)["kind"] == "connect" and fields(line)["reason"].startswith("TLS: "), fields(line)
    finally:
        server.close()
