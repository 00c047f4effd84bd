"""https:// upstreams on the wire, on both engines: verification, server name, mutual TLS,
pooling, streaming, and the errors a client sees when TLS fails."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import time
from typing import Any

import aiohttp
import orjson
import pytest

from sidecar.engine.fast_upstream import STALE_CHECK_AFTER
from tests.engine import RawMessage, echo, read_response, reply
from tests.tls.conftest import SERVER_NAME, Pki
from tests.waiting import wait_for

FAST = pytest.mark.parametrize("engine", ["fast"])
# The reason of a refusal that came without an alert (or whose alert a reset destroyed).
NO_ALERT = "closed by the upstream after the handshake (no alert)"


async def get(sc: Any, target: str = "/v1/models", headers: dict[str, str] | None = None) -> RawMessage:
    """One request on a new client connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    try:
        lines = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(f"GET {target} HTTP/1.1\r\nHost: x\r\n{lines}\r\n".encode())
        async with asyncio.timeout(10):
            return await read_response(reader)
    finally:
        writer.close()


def error_of(resp: RawMessage) -> dict[str, Any]:
    return orjson.loads(resp.body)["error"]  # type: ignore[no-any-return]


def assert_tls_failure(resp: RawMessage, pki: Pki, reason: str) -> None:
    """502 upstream_unreachable naming the deployment and the TLS reason; no paths, no address."""
    assert resp.status == 502, resp.body
    err = error_of(resp)
    assert err["type"] == "upstream_unreachable"
    assert err["deployment"] == "default" and err["upstream"] == 0
    assert err["message"] == f"upstream 0 of deployment 'default' is unreachable: TLS: {reason}", err
    body = resp.body.decode()
    assert str(pki.dir) not in body and "127.0.0.1" not in body and ".pem" not in body


# -- verification ------------------------------------------------------------------------------


async def test_upstream_verified_with_ca_file(pki, tls_upstream, start_sidecar):
    up = await tls_upstream(pki.server_context(), {"/v1/models": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    resp = await get(sc)
    assert resp.status == 200
    assert orjson.loads(resp.body)["target"] == "/v1/models"
    assert [r.target for r in up.received] == ["/v1/models"]
    assert up.received[0].header("Host") == f"127.0.0.1:{up.port}"


@pytest.mark.parametrize("tls", [None, "other_ca"])
async def test_unverifiable_upstream_is_502_certificate_verify_failed(pki, tls_upstream, start_sidecar, tls):
    """Without ca_file the system bundle cannot verify a private CA; another CA cannot either."""
    up = await tls_upstream(pki.server_context())
    keys = {"tls": {"ca_file": pki.other_ca_file}} if tls else {}
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, **keys)
    resp = await get(sc)
    assert_tls_failure(resp, pki, "CERTIFICATE_VERIFY_FAILED")
    assert up.received == []
    assert (
        sc.metrics.registry.get_sample_value(
            "sidecar_upstream_errors_total", {"deployment": "default", "kind": "connect"}
        )
        == 1
    )


async def test_verify_false_accepts_any_certificate(pki, tls_upstream, start_sidecar, caplog):
    up = await tls_upstream(pki.server_context())
    with caplog.at_level("WARNING", logger="sidecar.deployments"):
        sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"verify": False})
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "sidecar.deployments"] == [
        ("WARNING", "TLS verification is off: the upstreams' certificates are not checked")
    ]
    assert (await get(sc)).status == 200


async def test_server_name_sets_sni_and_the_checked_name(pki, tls_upstream, start_sidecar):
    """The certificate names upstream.test only: reaching it as 127.0.0.1 needs server_name."""
    up = await tls_upstream(pki.server_context(cert="named"))
    plain = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    assert_tls_failure(await get(plain), pki, "CERTIFICATE_VERIFY_FAILED")
    wrong = await start_sidecar(
        upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file, "server_name": "other.test"}
    )
    assert_tls_failure(await get(wrong), pki, "CERTIFICATE_VERIFY_FAILED")
    right = await start_sidecar(
        upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file, "server_name": SERVER_NAME}
    )
    resp = await get(right)
    assert resp.status == 200
    # SNI: none for an IP address, then the configured names.
    assert up.sni == [None, "other.test", SERVER_NAME]
    assert up.received[0].header("Host") == f"127.0.0.1:{up.port}"  # the Host header is unchanged


# -- mutual TLS --------------------------------------------------------------------------------


async def test_client_certificate_presented_for_mutual_tls(pki, tls_upstream, start_sidecar):
    up = await tls_upstream(pki.server_context(client_cert="required"))
    sc = await start_sidecar(
        upstream=up.url,
        readiness_check_upstream=False,
        tls={"ca_file": pki.ca_file, "cert_file": pki.cert_file, "key_file": pki.key_file},
    )
    assert (await get(sc)).status == 200
    subject = dict(item[0] for item in up.peer_certs[0]["subject"])
    assert subject == {"commonName": "sidecar.test"} or "sidecar.test" in str(up.peer_certs[0]["subjectAltName"])


@pytest.mark.parametrize(
    ("version", "reason"),
    [
        # TLS 1.3: the server checks the client's certificate after the client finished its side of
        # the handshake; the sidecar reads the refusal when the request is already written.
        (ssl.TLSVersion.TLSv1_3, "TLSV13_ALERT_CERTIFICATE_REQUIRED"),
        (ssl.TLSVersion.TLSv1_2, "SSLV3_ALERT_HANDSHAKE_FAILURE"),
    ],
)
async def test_mutual_tls_without_client_certificate_is_502(pki, threaded_tls_upstream, start_sidecar, version, reason):
    up = threaded_tls_upstream(pki.server_context(client_cert="required", max_version=version))
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    assert_tls_failure(await get(sc), pki, reason)
    assert up.received == []
    await wait_for(lambda: up.handshake_errors)
    # (the aiohttp client may try a GET twice: both were refused)
    assert set(up.handshake_errors) == {"PEER_DID_NOT_RETURN_A_CERTIFICATE"}


async def tree_on_first_of(start_sidecar: Any, urls: list[str], tls: dict[str, str]) -> tuple[Any, str]:
    """A sidecar whose deployment has the upstreams ``urls``, and a tree root the balancer
    places on the first."""
    sc = await start_sidecar(
        readiness_check_upstream=False, deployments=[{"name": "default", "upstreams": urls, "tls": tls}]
    )
    dep = sc.router.deployments[0]
    return sc, next(f"tree-{i}" for i in range(1000) if dep.pick_upstream(f"tree-{i}").index == 0)


@pytest.mark.parametrize("failure", ["verify", "client_certificate"])
async def test_tls_failure_fails_the_tree_over_like_a_refused_connect(
    pki, tls_upstream, threaded_tls_upstream, start_sidecar, failure
):
    if failure == "verify":
        bad: Any = await tls_upstream(pki.server_context(cert="named"))  # not valid for 127.0.0.1
    else:
        bad = threaded_tls_upstream(pki.server_context(client_cert="required"))
    good = await tls_upstream(pki.server_context(), {"/r": echo()})
    sc, root = await tree_on_first_of(start_sidecar, [bad.url, good.url], {"ca_file": pki.ca_file})
    first = await get(sc, "/r", {"X-Correlation-ID": root})
    assert first.status == 502 and error_of(first)["type"] == "upstream_unreachable"
    assert error_of(first)["upstream"] == 0
    second = await get(sc, "/r", {"X-Correlation-ID": root})
    assert second.status == 200
    assert [r.target for r in good.received] == ["/r"]


# A TLS 1.3 upstream refusing the sidecar's client certificate after the sidecar's side of the
# handshake, as servers do it: an alert then a gentle close (nginx, Envoy); an alert then an
# immediate close (a plain Python ``ssl`` server: a reset follows, and may overtake the alert
# in the sidecar's kernel); a bare close, no alert (servers on asyncio's TLS: aiohttp, uvicorn).
REFUSERS = ["alert", "alert_then_close", "bare_close"]
# The sidecar's client certificate: none, or one from a CA the upstream does not trust.
CLIENT_CERTS = {"none": "TLSV13_ALERT_CERTIFICATE_REQUIRED", "foreign": "TLSV1_ALERT_UNKNOWN_CA"}


async def refusing_upstream(refuser: str, pki: Pki, tls_upstream: Any, threaded_tls_upstream: Any) -> Any:
    """A TLS 1.3 upstream that requires a client certificate of the test CA."""
    ctx = pki.server_context(client_cert="required")
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    if refuser == "bare_close":
        return await tls_upstream(ctx, {"/r": echo()})
    return threaded_tls_upstream(ctx, gentle=refuser == "alert")


def refusal_reasons(refuser: str, client_cert: str) -> set[str]:
    """The TLS reasons the sidecar may give for the refusal."""
    alert = CLIENT_CERTS[client_cert]
    return {"alert": {alert}, "alert_then_close": {alert, NO_ALERT}, "bare_close": {NO_ALERT}}[refuser]


def client_tls(pki: Pki, client_cert: str) -> dict[str, str]:
    tls = {"ca_file": pki.ca_file}
    if client_cert == "foreign":
        tls.update(cert_file=pki.foreign_cert_file, key_file=pki.foreign_key_file)
    return tls


@pytest.mark.parametrize("client_cert", list(CLIENT_CERTS))
@pytest.mark.parametrize("refuser", REFUSERS)
async def test_tls13_refused_client_certificate_is_a_tls_failure(
    pki, tls_upstream, threaded_tls_upstream, start_sidecar, caplog, refuser, client_cert
):
    """502 upstream_unreachable with the TLS reason, in the answer and in the log line, as for a
    failed handshake; never "closed before responding" or "connection reset"."""
    up = await refusing_upstream(refuser, pki, tls_upstream, threaded_tls_upstream)
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls=client_tls(pki, client_cert))
    with caplog.at_level("WARNING", logger="sidecar.upstream"):
        resp = await get(sc, "/r")
    assert resp.status == 502, resp.body
    err = error_of(resp)
    assert err["type"] == "upstream_unreachable", err
    reason = err["message"].removeprefix("upstream 0 of deployment 'default' is unreachable: TLS: ")
    assert reason in refusal_reasons(refuser, client_cert), err
    assert "127.0.0.1" not in resp.body.decode() and str(pki.dir) not in resp.body.decode()
    lines = [r.getMessage() for r in caplog.records if r.name == "sidecar.upstream"]
    assert f"upstream failed: TLS: {reason}" in lines, lines
    assert up.received == []
    assert (
        sc.metrics.registry.get_sample_value(
            "sidecar_upstream_errors_total", {"deployment": "default", "kind": "connect"}
        )
        == 1
    )


@pytest.mark.parametrize("client_cert", list(CLIENT_CERTS))
@pytest.mark.parametrize("refuser", REFUSERS)
async def test_tls13_refused_client_certificate_fails_the_tree_over(
    pki, tls_upstream, threaded_tls_upstream, tls_recording_upstream, start_sidecar, refuser, client_cert
):
    """The tree's first request meets the refusal; every later one goes to the healthy upstream."""
    bad = await refusing_upstream(refuser, pki, tls_upstream, threaded_tls_upstream)
    good = await tls_recording_upstream(pki.server_context())
    sc, root = await tree_on_first_of(start_sidecar, [bad.url, good.url], client_tls(pki, client_cert))
    answers = [await get(sc, f"/r{n}", {"X-Correlation-ID": root}) for n in range(6)]
    assert [a.status for a in answers] == [502] + [200] * 5, [a.body for a in answers]
    assert error_of(answers[0])["type"] == "upstream_unreachable"
    assert error_of(answers[0])["upstream"] == 0
    assert [r.path for r in good.received] == [f"/r{n}" for n in range(1, 6)]
    assert bad.received == []


async def test_tls13_upstream_that_accepted_then_closed_is_no_tls_failure(
    pki, tls_upstream, tls_recording_upstream, start_sidecar
):
    """A TLS 1.3 upstream that accepted the session (it sent its session tickets) and closed a new
    connection without responding failed the request, not the handshake: 502
    upstream_protocol_error, and the tree stays on it."""
    ctx = pki.server_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    closing = await tls_upstream(ctx, {"/close": reply(b"", keep=False), "/r": echo()})
    good = await tls_recording_upstream(pki.server_context())
    sc, root = await tree_on_first_of(start_sidecar, [closing.url, good.url], {"ca_file": pki.ca_file})
    first = await get(sc, "/close", {"X-Correlation-ID": root})
    assert first.status == 502 and error_of(first)["type"] == "upstream_protocol_error", first.body
    second = await get(sc, "/r", {"X-Correlation-ID": root})
    assert second.status == 200
    assert [r.target for r in closing.received][-1] == "/r"
    assert good.received == []


# -- pooling -----------------------------------------------------------------------------------


async def test_sequential_requests_reuse_one_tls_connection(pki, tls_upstream, start_sidecar):
    up = await tls_upstream(pki.server_context(), {"/r": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    for _ in range(30):
        assert (await get(sc, "/r")).status == 200
    assert len(up.received) == 30
    assert up.connections == 1
    assert {r.conn for r in up.received} == {1}


async def test_deployments_with_other_tls_settings_never_share_a_connection(pki, tls_upstream, start_sidecar):
    """Same host:port, one deployment with a client certificate, one without."""
    up = await tls_upstream(pki.server_context(client_cert="optional"), {"/r": echo()})
    sc = await start_sidecar(
        readiness_check_upstream=False,
        deployments=[
            {"name": "anon", "upstreams": [up.url], "tls": {"ca_file": pki.ca_file}},
            {
                "name": "mtls",
                "upstreams": [up.url],
                "tls": {"ca_file": pki.ca_file, "cert_file": pki.cert_file, "key_file": pki.key_file},
            },
        ],
    )
    for name in ["anon", "mtls"] * 4:
        assert (await get(sc, "/r", {"X-Sidecar-Deployment": name})).status == 200
    assert up.connections == 2
    with_cert = {n + 1 for n, cert in enumerate(up.peer_certs) if cert}
    assert len(with_cert) == 1
    assert [r.conn in with_cert for r in up.received] == [False, True] * 4


async def test_pooled_tls_connection_closed_by_the_upstream_is_not_used(pki, tls_upstream, start_sidecar):
    async def close_after_reply(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # close_notify, then waits for the sidecar's own close_notify
        await writer.wait_closed()
        return False

    up = await tls_upstream(pki.server_context(), {"/one": close_after_reply, "/two": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    assert (await get(sc, "/one")).status == 200
    await wait_for(lambda: 1 in up.closed_at)  # the sidecar answered the close
    resp = await get(sc, "/two")
    assert resp.status == 200
    assert [(r.target, r.conn) for r in up.received] == [("/one", 1), ("/two", 2)]


async def test_stray_bytes_after_a_response_end_the_tls_connection(pki, tls_upstream, start_sidecar):
    async def stray(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nstray")
        await writer.drain()
        return True

    up = await tls_upstream(pki.server_context(), {"/one": stray, "/two": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    first = await get(sc, "/one")
    assert (first.status, first.body) == (200, b"ok")
    second = await get(sc, "/two")
    assert second.status == 200
    assert orjson.loads(second.body)["target"] == "/two"  # its own response, not the stray one
    assert [(r.target, r.conn) for r in up.received] == [("/one", 1), ("/two", 2)]


@FAST
async def test_tcp_fin_in_the_socket_unprocessed_is_seen_before_reuse(pki, tls_upstream, start_sidecar):
    """The race: the upstream's FIN (no close_notify) is in the socket, the loop has not
    processed it yet, and the next request arrives in the same loop iteration."""
    sockets: list[Any] = []

    async def remember(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        sockets.append(writer.get_extra_info("socket"))
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        try:
            await reader.read()
        except (ssl.SSLError, ConnectionError):
            pass
        return False

    up = await tls_upstream(pki.server_context(), {"/one": remember, "/two": echo()})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    writer.write(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_response(reader)).status == 200
    await asyncio.sleep(STALE_CHECK_AFTER * 2)  # idle long enough to be checked before reuse
    os.write(writer.get_extra_info("socket").fileno(), b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n")
    with socket.socket(fileno=os.dup(sockets[0].fileno())) as raw:  # uvloop's socket objects cannot shut down
        raw.shutdown(socket.SHUT_RDWR)
    time.sleep(0.05)  # both events wait for the loop, which runs them in one iteration
    resp = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert resp.status == 200
    assert orjson.loads(resp.body)["target"] == "/two"
    assert [(r.target, r.conn) for r in up.received] == [("/one", 1), ("/two", 2)]


@FAST
async def test_close_notify_in_the_socket_unprocessed_is_seen_before_reuse(pki, threaded_tls_upstream, start_sidecar):
    """The same race with a TLS close_notify ahead of the FIN (sent from another thread while
    the loop is blocked)."""
    up = threaded_tls_upstream(pki.server_context(), close_notify=True)
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    reader, writer = await asyncio.open_connection("127.0.0.1", sc.engine.port)
    writer.write(b"GET /one HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_response(reader)).status == 200
    await asyncio.sleep(STALE_CHECK_AFTER * 2)
    os.write(writer.get_extra_info("socket").fileno(), b"GET /two HTTP/1.1\r\nHost: x\r\n\r\n")
    up.close_now.set()
    time.sleep(0.05)
    resp = await asyncio.wait_for(read_response(reader), 5)
    writer.close()
    assert resp.status == 200
    assert orjson.loads(resp.body) == {"target": "/two", "conn": 2}
    assert up.received == [(1, "/one"), (2, "/two")]


async def test_handshake_bounded_by_the_connect_timeout(pki, start_sidecar):
    """An upstream that accepts TCP and never answers the ClientHello: 504 after timeouts.connect."""
    accepted: list[asyncio.StreamWriter] = []
    closed = asyncio.Event()

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)
        await reader.read()  # until the sidecar gives up and closes
        writer.close()
        closed.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sc = await start_sidecar(
            upstream=f"https://127.0.0.1:{port}",
            readiness_check_upstream=False,
            tls={"ca_file": pki.ca_file},
            timeouts={"connect": 0.3},
        )
        resp = await get(sc)
        assert resp.status == 504
        assert error_of(resp)["type"] == "upstream_timeout"
        assert accepted  # the TCP connection was made: the handshake is what timed out
        await asyncio.wait_for(closed.wait(), 5)  # and the sidecar closed it
    finally:
        for writer in accepted:
            writer.close()
        server.close()
        await server.wait_closed()


# -- streaming ---------------------------------------------------------------------------------


async def test_sse_over_tls_is_relayed_event_by_event(pki, tls_upstream, start_sidecar):
    released = [asyncio.Event() for _ in range(3)]

    async def sse(req: RawMessage, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(3):
            event = b'data: {"i":%d}\n\n' % i
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await released[i].wait()  # the next event only once the client got this one
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True

    up = await tls_upstream(pki.server_context(), {"/sse": sse})
    sc = await start_sidecar(upstream=up.url, readiness_check_upstream=False, tls={"ca_file": pki.ca_file})
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.proxy_url}/sse", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            assert resp.headers["Content-Type"] == "text/event-stream"
            for i in range(3):
                assert await resp.content.readuntil(b"\n\n") == b'data: {"i":%d}\n\n' % i
                released[i].set()
            assert await resp.read() == b""


async def test_plain_http_server_behind_an_https_url_is_502_wrong_version(pki, start_sidecar):
    async def plain_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)  # the ClientHello: not HTTP, answered like an HTTP server would
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(plain_http, "127.0.0.1", 0)
    try:
        port = server.sockets[0].getsockname()[1]
        sc = await start_sidecar(
            upstream=f"https://127.0.0.1:{port}", readiness_check_upstream=False, tls={"ca_file": pki.ca_file}
        )
        assert_tls_failure(await get(sc), pki, "WRONG_VERSION_NUMBER")
    finally:
        server.close()
        await server.wait_closed()
