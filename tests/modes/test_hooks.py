"""Each built-in mode's hooks on hand-built routing contexts (no sockets)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from sidecar.jsonbody import scan_body, splice
from sidecar.modes.base import Mode, RoutingContext, check_contract
from sidecar.modes.dynamo import DynamoHeaders, DynamoNvext
from sidecar.modes.generic import IdentityHeaders, SessionIdHeader
from sidecar.modes.ids import fit_id
from sidecar.modes.registry import load_mode
from sidecar.modes.smg import SmgRoutingKey

LONG = "agent/" + "x" * 294  # 300 bytes


def ctx(
    session: str = "s1",
    *,
    parent: str | None = None,
    root: str | None = None,
    final: bool = False,
    tree_final: bool = False,
    turn: int = 2,
    parent_final: bool | None = None,
) -> RoutingContext:
    return RoutingContext(
        session=session,
        parent=parent,
        root=root or parent or session,
        is_final_turn=final,
        is_parent_final=parent_final,
        is_tree_final=tree_final,
        turn=turn,
        deployment="default",
    )


def mode(name: str, **options: Any) -> Mode:
    return load_mode(name).from_options(options)


@pytest.mark.parametrize(
    "name,cls",
    [
        ("dynamo_headers", DynamoHeaders),
        ("dynamo_nvext", DynamoNvext),
        ("smg_routing_key", SmgRoutingKey),
        ("session_id_header", SessionIdHeader),
        ("identity_headers", IdentityHeaders),
    ],
)
def test_builtins_come_from_entry_points_and_meet_the_contract(name: str, cls: type[Mode]) -> None:
    assert load_mode(name) is cls
    assert check_contract(cls) is cls
    assert cls.mutates_body is (name == "dynamo_nvext")


# -- dynamo_headers ---------------------------------------------------------------------------


def test_dynamo_headers_root_and_child() -> None:
    m = mode("dynamo_headers")
    assert list(m.request_headers(ctx("s1", turn=1))) == [("X-Dynamo-Session-ID", "s1")]
    assert list(m.request_headers(ctx("c1", parent="p1", root="r1", final=True))) == [
        ("X-Dynamo-Session-ID", "c1"),
        ("X-Dynamo-Parent-Session-ID", "p1"),
    ]
    assert set(m.emitted_headers()) == {"X-Dynamo-Session-ID", "X-Dynamo-Parent-Session-ID"}


def test_dynamo_headers_fits_long_session_and_parent_ids() -> None:
    m = mode("dynamo_headers")
    out = dict(m.request_headers(ctx(LONG + "-child", parent=LONG)))
    assert out["X-Dynamo-Session-ID"] == fit_id(LONG + "-child", 256)
    assert out["X-Dynamo-Parent-Session-ID"] == fit_id(LONG, 256)
    assert all(len(v.encode()) <= 256 for v in out.values())
    assert out["X-Dynamo-Session-ID"] != out["X-Dynamo-Parent-Session-ID"]


# -- dynamo_nvext -----------------------------------------------------------------------------


def apply(m: Mode, c: RoutingContext, body: dict[str, Any] | bytes) -> bytes:
    """The bytes the mode's patch makes of ``body`` (given as JSON bytes, or a dict to serialize)."""
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    patch = m.body_patch(c)
    if patch is None:
        return data
    return splice(scan_body(data, 128, ()), patch.path, patch.values, patch.owned)


def sc(m: Mode, c: RoutingContext, body: dict[str, Any] | None = None) -> Any:
    out = orjson.loads(apply(m, c, {"model": "m"} if body is None else body))
    return out.get("nvext", {}).get("session_control")


def test_nvext_bind_protocol_session_scope() -> None:
    m = mode("dynamo_nvext", protocol="bind", timeout_seconds=123)
    assert sc(m, ctx("s1", turn=1)) == {"session_id": "s1", "action": "bind", "timeout": 123}
    assert sc(m, ctx("s1", turn=2)) == {"session_id": "s1", "action": "bind", "timeout": 123}
    assert sc(m, ctx("s1", turn=3, final=True)) == {"session_id": "s1", "action": "close"}
    # Even a first turn that is final closes: bind needs no prior open.
    assert sc(m, ctx("s1", turn=1, final=True)) == {"session_id": "s1", "action": "close"}
    assert m.emitted_headers() == ()


def test_nvext_default_timeout_is_300() -> None:
    assert sc(mode("dynamo_nvext", protocol="bind"), ctx()) == {"session_id": "s1", "action": "bind", "timeout": 300}


def test_nvext_default_protocol_is_open() -> None:
    m = mode("dynamo_nvext")
    assert sc(m, ctx("s1", turn=1)) == {"session_id": "s1", "action": "open", "timeout": 300}
    assert sc(m, ctx("s1", turn=2)) == {"session_id": "s1"}


def test_nvext_tree_scope_uses_root_and_closes_only_when_tree_final() -> None:
    m = mode("dynamo_nvext", protocol="bind", scope="tree", timeout_seconds=7)
    assert sc(m, ctx("c1", parent="r1", turn=1)) == {"session_id": "r1", "action": "bind", "timeout": 7}
    # The child's final turn while the tree lives on: still a bind on the root.
    assert sc(m, ctx("c1", parent="r1", final=True)) == {"session_id": "r1", "action": "bind", "timeout": 7}
    assert sc(m, ctx("r1", final=True, tree_final=True)) == {"session_id": "r1", "action": "close"}
    assert sc(m, ctx("c1", parent="r1", final=True, tree_final=True)) == {"session_id": "r1", "action": "close"}


def test_nvext_open_protocol_session_scope() -> None:
    m = mode("dynamo_nvext", protocol="open", timeout_seconds=45)
    assert sc(m, ctx("s1", turn=1)) == {"session_id": "s1", "action": "open", "timeout": 45}
    assert sc(m, ctx("s1", turn=2)) == {"session_id": "s1"}
    assert sc(m, ctx("s1", turn=9)) == {"session_id": "s1"}
    assert sc(m, ctx("s1", turn=3, final=True)) == {"session_id": "s1", "action": "close"}


def test_nvext_open_protocol_one_turn_session_sends_nothing_and_keeps_body() -> None:
    m = mode("dynamo_nvext", protocol="open")
    assert m.body_patch(ctx("s1", turn=1, final=True)) is None
    body = b'{"model": "m", "nvext": {"top_k": 3, "session_control": {"action": "open"}}}'
    assert apply(m, ctx("s1", turn=1, final=True), body) == body


def test_nvext_open_protocol_tree_scope_opens_on_root_first_turn_only() -> None:
    m = mode("dynamo_nvext", protocol="open", scope="tree", timeout_seconds=60)
    assert sc(m, ctx("r1", turn=1)) == {"session_id": "r1", "action": "open", "timeout": 60}
    assert sc(m, ctx("c1", parent="r1", turn=1)) == {"session_id": "r1"}
    assert sc(m, ctx("c1", parent="r1", turn=2, final=True)) == {"session_id": "r1"}
    assert sc(m, ctx("r1", turn=2, final=True, tree_final=True)) == {"session_id": "r1", "action": "close"}


def test_nvext_fits_long_ids() -> None:
    m = mode("dynamo_nvext", protocol="bind")
    got = sc(m, ctx(LONG))
    assert got["session_id"] == fit_id(LONG, 256) and len(got["session_id"].encode()) <= 256
    got = sc(mode("dynamo_nvext", protocol="bind", scope="tree"), ctx("c", parent=LONG))
    assert got["session_id"] == fit_id(LONG, 256)


def test_nvext_merge_keeps_client_keys_and_mode_keys_win() -> None:
    m = mode("dynamo_nvext", protocol="bind", timeout_seconds=123)
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "nvext": {
            "top_k": 5,
            "extra_fields": ["worker_id"],
            "session_control": {"session_id": "client", "action": "open", "timeout": 9, "note": "x"},
        },
    }
    assert orjson.loads(apply(m, ctx("s1"), body)) == {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "nvext": {
            "top_k": 5,
            "extra_fields": ["worker_id"],
            "session_control": {"session_id": "s1", "action": "bind", "timeout": 123, "note": "x"},
        },
    }
    # Spliced into the client's bytes: the client's other members stay as sent, the mode's
    # members follow them.
    assert apply(m, ctx("s1"), orjson.dumps(body)) == (
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"nvext":{"top_k":5,"extra_fields":["worker_id"],'
        b'"session_control":{"note":"x","session_id":"s1","action":"bind","timeout":123}}}'
    )


def test_nvext_close_drops_client_timeout_and_middle_open_turn_drops_action() -> None:
    client = {"nvext": {"session_control": {"action": "open", "timeout": 9, "keep": 1}}}
    assert sc(mode("dynamo_nvext", protocol="bind"), ctx(final=True), client) == {
        "session_id": "s1",
        "action": "close",
        "keep": 1,
    }
    assert sc(mode("dynamo_nvext", protocol="open"), ctx(turn=2), client) == {"session_id": "s1", "keep": 1}


@pytest.mark.parametrize("nvext", [None, "text", 7, ["a"], True])
def test_nvext_non_object_nvext_is_replaced(nvext: Any) -> None:
    out = orjson.loads(apply(mode("dynamo_nvext", protocol="bind"), ctx(), {"model": "m", "nvext": nvext}))
    assert out == {"model": "m", "nvext": {"session_control": {"session_id": "s1", "action": "bind", "timeout": 300}}}


@pytest.mark.parametrize("control", [None, "open", 3, ["x"]])
def test_nvext_non_object_session_control_is_replaced(control: Any) -> None:
    out = orjson.loads(
        apply(mode("dynamo_nvext", protocol="bind"), ctx(), {"nvext": {"session_control": control, "k": 1}})
    )
    assert out == {"nvext": {"k": 1, "session_control": {"session_id": "s1", "action": "bind", "timeout": 300}}}


def test_nvext_body_without_nvext() -> None:
    out = orjson.loads(apply(mode("dynamo_nvext", protocol="bind"), ctx(), {"model": "m", "stream": True}))
    assert out == {
        "model": "m",
        "stream": True,
        "nvext": {"session_control": {"session_id": "s1", "action": "bind", "timeout": 300}},
    }


# -- smg_routing_key --------------------------------------------------------------------------


def test_smg_routing_key_scopes() -> None:
    assert list(mode("smg_routing_key").request_headers(ctx("c1", parent="r1"))) == [("X-SMG-Routing-Key", "c1")]
    assert list(mode("smg_routing_key", scope="tree").request_headers(ctx("c1", parent="r1"))) == [
        ("X-SMG-Routing-Key", "r1")
    ]
    assert list(mode("smg_routing_key").emitted_headers()) == ["X-SMG-Routing-Key"]


def test_smg_routing_key_fits_128_bytes() -> None:
    ok = "k" * 128
    assert list(mode("smg_routing_key").request_headers(ctx(ok))) == [("X-SMG-Routing-Key", ok)]
    [(_, key)] = mode("smg_routing_key").request_headers(ctx(ok + "k"))
    assert len(key.encode()) <= 128 and key == fit_id(ok + "k", 128) and key != ok


# -- session_id_header ------------------------------------------------------------------------


def test_session_id_header_defaults_and_options() -> None:
    m = mode("session_id_header")
    assert list(m.request_headers(ctx("c1", parent="r1"))) == [("X-Session-ID", "c1")]
    assert list(m.emitted_headers()) == ["X-Session-ID"]
    m = mode("session_id_header", header_name=" x-my-key ", scope="tree")
    assert list(m.request_headers(ctx("c1", parent="r1"))) == [("x-my-key", "r1")]
    assert list(m.emitted_headers()) == ["x-my-key"]
    # Not an SMG/Dynamo mode: ids are passed as they are.
    assert list(mode("session_id_header").request_headers(ctx(LONG))) == [("X-Session-ID", LONG)]


# -- identity_headers -------------------------------------------------------------------------


def test_identity_headers_tiers() -> None:
    m = mode("identity_headers", session="X-S1, X-S2", parent=["X-P1", " X-P2 "], root="X-R1,X-R2")
    assert list(m.emitted_headers()) == ["X-S1", "X-S2", "X-P1", "X-P2", "X-R1", "X-R2"]
    assert list(m.request_headers(ctx("r", turn=1))) == [("X-S1", "r"), ("X-S2", "r"), ("X-R1", "r"), ("X-R2", "r")]
    assert list(m.request_headers(ctx("c", parent="p", root="r"))) == [
        ("X-S1", "c"),
        ("X-S2", "c"),
        ("X-P1", "p"),
        ("X-P2", "p"),
        ("X-R1", "r"),
        ("X-R2", "r"),
    ]


def test_identity_headers_single_tier() -> None:
    m = mode("identity_headers", parent="X-Up")
    assert list(m.request_headers(ctx("r"))) == []
    assert list(m.request_headers(ctx("c", parent="p"))) == [("X-Up", "p")]


def test_header_only_modes_do_not_declare_body_work() -> None:
    for name in ("dynamo_headers", "smg_routing_key", "session_id_header", "identity_headers"):
        cls = load_mode(name)
        assert cls.mutates_body is False
        assert cls.transform_body is Mode.transform_body
        assert cls.body_patch is Mode.body_patch
