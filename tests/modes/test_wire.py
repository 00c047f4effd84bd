"""Every mode on the wire: 2+ sessions x 3 turns through a real sidecar into the recording upstream.

Options use non-default values so that every option's plumbing shows in what the upstream got.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from sidecar.modes.ids import fit_id
from tests.modes.wire import ODD_BODY, Step, drive, plan
from tests.upstream import Received

LONG_A = "conv-A/" + "a" * 293  # 300 bytes: fitted for SMG (128) and Dynamo (256)
assert len(LONG_A.encode()) == 300

# Every header any built-in mode could emit in these tests: each request is checked for all of them.
WATCHED = (
    "X-Dynamo-Session-ID",
    "X-Dynamo-Parent-Session-ID",
    "X-SMG-Routing-Key",
    "X-Session-ID",
    "X-Route-Key",
    "X-S-One",
    "X-S-Two",
    "X-P-One",
    "X-P-Two",
    "X-R-One",
    "X-R-Two",
)


def assert_headers(rec: Received, expected: dict[str, str], step: Step) -> None:
    """``expected`` values exactly once each; every other watched header absent; no duplicated names."""
    for name in WATCHED:
        want = [expected[name]] if name in expected else []
        assert rec.all(name) == want, (name, step)
    names = [k.lower() for k, _ in rec.headers]
    assert len(names) == len(set(names)), rec.headers
    # The identity the client sent is forwarded as it was.
    assert rec.all("X-Correlation-ID") == [step.session]
    assert rec.all("X-Session-Final") == (["true"] if step.final else [])


# Two sessions, root A and its child B; A's last turn comes after B's so the tree ends on it.
ROOT_AND_CHILD = [(LONG_A, None), ("conv-B", LONG_A)]
ORDER = [0, 1, 0, 1, 1, 0]


async def test_dynamo_headers_matrix(upstream, start_sidecar) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    steps = plan(ROOT_AND_CHILD, ORDER)
    # A spoofed copy is replaced, never duplicated. (X-Dynamo-Parent-Session-ID is also an inbound
    # parent signal, so a client copy of it declares the parent rather than spoofing the output.)
    await drive(sc, steps, ODD_BODY, extra={"x-dynamo-session-id": "spoof"})
    assert len(upstream.received) == 6
    for rec, step in zip(upstream.received, steps, strict=True):
        want = {"X-Dynamo-Session-ID": fit_id(step.session, 256)}
        if step.parent is not None:
            want["X-Dynamo-Parent-Session-ID"] = fit_id(step.parent, 256)
        assert_headers(rec, want, step)
        assert rec.body == ODD_BODY
    assert upstream.received[0].header("X-Dynamo-Session-ID") != LONG_A
    assert len(upstream.received[0].header("X-Dynamo-Session-ID").encode()) == 256


@pytest.mark.parametrize("scope", ["session", "tree"])
async def test_smg_routing_key_matrix(upstream, start_sidecar, scope: str) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="smg_routing_key", mode_opt=[f"scope={scope}"])
    steps = plan(ROOT_AND_CHILD, ORDER)
    await drive(sc, steps, ODD_BODY, extra={"x-smg-routing-key": "spoof"})
    for rec, step in zip(upstream.received, steps, strict=True):
        key = LONG_A if scope == "tree" else step.session
        assert_headers(rec, {"X-SMG-Routing-Key": fit_id(key, 128)}, step)
        assert rec.body == ODD_BODY
    keys = {rec.header("X-SMG-Routing-Key") for rec in upstream.received}
    assert keys == ({fit_id(LONG_A, 128)} if scope == "tree" else {fit_id(LONG_A, 128), "conv-B"})
    assert all(len(k.encode()) <= 128 for k in keys)


@pytest.mark.parametrize("scope", ["session", "tree"])
async def test_session_id_header_matrix(upstream, start_sidecar, scope: str) -> None:
    sc = await start_sidecar(
        upstream=upstream.url, mode="session_id_header", mode_opt=["header_name=X-Route-Key", f"scope={scope}"]
    )
    sessions = [("route-A", None), ("route-B", "route-A")]
    steps = plan(sessions, ORDER)
    await drive(sc, steps, ODD_BODY, extra={"X-Route-Key": "spoof"})
    for rec, step in zip(upstream.received, steps, strict=True):
        assert_headers(rec, {"X-Route-Key": "route-A" if scope == "tree" else step.session}, step)
        assert rec.body == ODD_BODY


async def test_session_id_header_does_not_fit_ids(upstream, start_sidecar) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="session_id_header")
    await drive(sc, plan([(LONG_A, None)], [0, 0, 0]), ODD_BODY)
    assert [r.all("X-Session-ID") for r in upstream.received] == [[LONG_A]] * 3


async def test_identity_headers_matrix(upstream, start_sidecar) -> None:
    sc = await start_sidecar(
        upstream=upstream.url,
        mode="identity_headers",
        mode_opt=["session=X-S-One, X-S-Two", "parent=X-P-One,X-P-Two", "root=X-R-One ,X-R-Two"],
    )
    # Root, child and grandchild: session, parent and root ids all differ for the grandchild.
    sessions = [("id-root", None), ("id-child", "id-root"), ("id-grand", "id-child")]
    steps = plan(sessions, [0, 1, 2, 0, 1, 2, 2, 1, 0])
    await drive(sc, steps, ODD_BODY, extra={"x-s-one": "spoof", "X-R-TWO": "spoof"})
    assert len(upstream.received) == 9
    for rec, step in zip(upstream.received, steps, strict=True):
        want = {"X-S-One": step.session, "X-S-Two": step.session, "X-R-One": "id-root", "X-R-Two": "id-root"}
        if step.parent is not None:
            want |= {"X-P-One": step.parent, "X-P-Two": step.parent}
        assert_headers(rec, want, step)
        assert rec.body == ODD_BODY


# -- dynamo_nvext -----------------------------------------------------------------------------

CLIENT_BODY = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "nvext": {"extra_fields": ["worker_id"], "session_control": {"timeout": 1, "trace": "t-1"}},
}


def nvext_expected(step: Step, control: dict[str, Any] | None) -> dict[str, Any]:
    nvext: dict[str, Any] = {"extra_fields": ["worker_id"]}
    if control is None:
        nvext["session_control"] = {"timeout": 1, "trace": "t-1"}
    else:
        nvext["session_control"] = {"trace": "t-1", **control}
    return {**CLIENT_BODY, "nvext": nvext}


async def run_nvext(
    upstream, start_sidecar, opts: list[str], sessions: list[tuple[str, str | None]], order: list[int]
) -> list[Step]:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=opts)
    steps = plan(sessions, order)
    await drive(sc, steps, orjson.dumps(CLIENT_BODY))
    assert len(upstream.received) == len(steps)
    for rec in upstream.received:
        for name in WATCHED:  # a body mode adds no headers
            assert rec.all(name) == []
        assert rec.header("Content-Length") == str(len(rec.body))
    return steps


async def test_dynamo_nvext_bind_tree_matrix(upstream, start_sidecar) -> None:
    steps = await run_nvext(
        upstream, start_sidecar, ["timeout_seconds=123", "protocol=bind", "scope=tree"], ROOT_AND_CHILD, ORDER
    )
    root = fit_id(LONG_A, 256)
    bind = {"session_id": root, "action": "bind", "timeout": 123}
    # B's final turn leaves the tree alive: still a bind; A's final turn ends the tree: close.
    expected = [bind, bind, bind, bind, bind, {"session_id": root, "action": "close"}]
    for rec, step, control in zip(upstream.received, steps, expected, strict=True):
        assert rec.json() == nvext_expected(step, control), step


async def test_dynamo_nvext_bind_session_matrix(upstream, start_sidecar) -> None:
    sessions = [(LONG_A, None), ("conv-C", None)]
    steps = await run_nvext(
        upstream, start_sidecar, ["timeout_seconds=123", "protocol=bind"], sessions, [0, 1, 0, 1, 0, 1]
    )
    for rec, step in zip(upstream.received, steps, strict=True):
        sid = fit_id(step.session, 256)
        control = (
            {"session_id": sid, "action": "close"}
            if step.final
            else {"session_id": sid, "action": "bind", "timeout": 123}
        )
        assert rec.json() == nvext_expected(step, control), step


async def test_dynamo_nvext_sends_what_the_releases_accept_by_default(upstream, start_sidecar) -> None:
    """No options: open / - / close (Dynamo 1.1.x-1.2.x answer bind with HTTP 400)."""
    steps = await run_nvext(upstream, start_sidecar, [], [("conv-D", None)], [0, 0, 0])
    expected = [
        {"session_id": "conv-D", "action": "open", "timeout": 300},
        {"session_id": "conv-D"},
        {"session_id": "conv-D", "action": "close"},
    ]
    for rec, step, control in zip(upstream.received, steps, expected, strict=True):
        assert rec.json() == nvext_expected(step, control), step


async def test_dynamo_nvext_open_session_matrix(upstream, start_sidecar) -> None:
    sessions = [(LONG_A, None), ("conv-C", None)]
    steps = await run_nvext(
        upstream, start_sidecar, ["timeout_seconds=123", "protocol=open"], sessions, [0, 1, 0, 1, 0, 1]
    )
    for rec, step in zip(upstream.received, steps, strict=True):
        sid = fit_id(step.session, 256)
        control = {
            1: {"session_id": sid, "action": "open", "timeout": 123},
            2: {"session_id": sid},
            3: {"session_id": sid, "action": "close"},
        }[step.turn]
        assert rec.json() == nvext_expected(step, control), step


async def test_dynamo_nvext_open_tree_matrix(upstream, start_sidecar) -> None:
    steps = await run_nvext(
        upstream, start_sidecar, ["timeout_seconds=123", "protocol=open", "scope=tree"], ROOT_AND_CHILD, ORDER
    )
    root = fit_id(LONG_A, 256)
    expected = [
        {"session_id": root, "action": "open", "timeout": 123},
        {"session_id": root},
        {"session_id": root},
        {"session_id": root},
        {"session_id": root},
        {"session_id": root, "action": "close"},
    ]
    for rec, step, control in zip(upstream.received, steps, expected, strict=True):
        assert rec.json() == nvext_expected(step, control), step


# -- trusted clients --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mode,opts,sent",
    [
        ("dynamo_headers", [], {"X-Dynamo-Session-ID": "client-own"}),
        ("smg_routing_key", [], {"X-SMG-Routing-Key": "client-own"}),
        ("session_id_header", ["header_name=X-Route-Key"], {"X-Route-Key": "client-own"}),
        ("identity_headers", ["session=X-S-One", "root=X-R-One"], {"X-S-One": "client-own"}),
    ],
)
async def test_trusted_client_copies_are_kept(
    upstream, start_sidecar, mode: str, opts: list[str], sent: dict[str, str]
) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode=mode, mode_opt=opts, trust_client_headers=True)
    await drive(sc, plan([("trust-A", None)], [0, 0, 0]), ODD_BODY, extra=sent)
    for rec in upstream.received:
        for name, value in sent.items():
            assert rec.all(name) == [value]
        assert rec.body == ODD_BODY
