"""Session identity from the clients people run, on the wire: header and body signals."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from sidecar.identity import FINGERPRINT_PREFIX


async def post(sc, body: bytes, headers: dict[str, str] | None = None, path: str = "/v1/chat/completions") -> None:
    async with aiohttp.ClientSession() as s:
        async with s.post(sc.proxy_url + path, data=body, headers=headers or {}) as resp:
            assert resp.status == 200, await resp.text()


def sessions(upstream) -> list[str | None]:
    return [r.header("X-Dynamo-Session-ID") for r in upstream.received]


@pytest.mark.parametrize(
    ("header", "client"),
    [
        ("X-Session-Affinity", "opencode / AIPerf"),
        ("x-claude-code-session-id", "Claude Code"),
        ("thread-id", "Codex"),
    ],
)
async def test_agent_client_header_signals(upstream, start_sidecar, header, client):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    await post(sc, b"{}", {header: f"id-{client}"})
    assert sessions(upstream) == [f"id-{client}"]


async def test_codex_session_id_names_the_root_never_the_session(upstream, start_sidecar):
    # Codex sends `session-id` (the main thread) on every request, its sub-agents' included:
    # alone it names no session; with `thread-id` it is the thread's root.
    sc = await start_sidecar(upstream=upstream.url, mode="identity_headers", mode_opt=["session=X-S", "root=X-R"])
    await post(sc, b"{}", {"session-id": "main"})
    await post(sc, b"{}", {"session-id": "main", "session_id": "main"})
    await post(sc, b"{}", {"session-id": "main", "thread-id": "sub"})
    got = [(r.header("X-S"), r.header("X-R")) for r in upstream.received]
    assert got == [(None, None), (None, None), ("sub", "main")]


async def test_header_signal_precedence(upstream, start_sidecar):
    sc = await start_sidecar(
        upstream=upstream.url, mode="dynamo_headers", identity={"body": ["prompt_cache_key"], "fingerprint": True}
    )
    body = orjson.dumps({"prompt_cache_key": "from-body", "messages": [{"role": "user", "content": "hi"}]})
    await post(
        sc, body, {"thread-id": "codex-thread", "x-claude-code-session-id": "claude", "X-Correlation-ID": "corr"}
    )
    await post(sc, body, {"thread-id": "codex-thread", "x-claude-code-session-id": "claude"})
    await post(sc, body, {"thread-id": "codex-thread"})
    await post(sc, body)  # no header: body signals, in configured order, before the fingerprint
    assert sessions(upstream) == ["corr", "claude", "codex-thread", "from-body"]


async def test_body_signals_in_configured_order_and_body_unchanged(upstream, start_sidecar):
    sc = await start_sidecar(
        upstream=upstream.url,
        mode="dynamo_headers",
        identity={"body": ["metadata.user_id", "user", "prompt_cache_key"]},
    )
    claude = {
        "model": "m",
        "metadata": {
            "user_id": orjson.dumps({"device_id": "d", "account_uuid": "a", "session_id": "claude-sess"}).decode()
        },
    }
    bodies = [
        orjson.dumps({"prompt_cache_key": "pck", "user": "u-1"}),  # user before prompt_cache_key
        orjson.dumps({"prompt_cache_key": "pck"}),
        orjson.dumps(claude),
        b'{"metadata": {"user_id": "user_abc_account_def_session_legacy-1"}}',
        b' {"user":  "spaced" }\n',
        b"not json at all",
    ]
    for body in bodies:
        await post(sc, body, path="/v1/messages")
    assert sessions(upstream) == ["u-1", "pck", "claude-sess", "legacy-1", "spaced", None]
    # Header-only mode: the body that was parsed for identity is forwarded byte for byte.
    assert [r.body for r in upstream.received] == bodies


async def test_body_signals_are_not_read_unless_configured(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers")
    await post(sc, orjson.dumps({"prompt_cache_key": "pck", "user": "u"}))
    assert sessions(upstream) == [None]


def conversation(system: str, first: str, turns: int) -> list[bytes]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": first}]
    out = []
    for t in range(turns):
        out.append(orjson.dumps({"model": "m", "messages": messages, "stream": True}))
        messages = [
            *messages,
            {"role": "assistant", "content": f"answer {t}"},
            {"role": "user", "content": f"follow-up {t}"},
        ]
    return out


async def test_fingerprint_maps_every_turn_of_a_conversation_to_one_session(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", identity={"fingerprint": True})
    a = conversation("You are terse.", "Plan a trip to Lyon.", 4)
    b = conversation("You are terse.", "Plan a trip to Oslo.", 4)
    c = conversation("You are verbose.", "Plan a trip to Lyon.", 2)
    for body in [x for pair in zip(a, b) for x in pair] + c:
        await post(sc, body)
    got = sessions(upstream)
    sa, sb, sc_ = set(got[0:8:2]), set(got[1:8:2]), set(got[8:])
    assert len(sa) == len(sb) == len(sc_) == 1
    assert len(sa | sb | sc_) == 3
    assert all(s.startswith(FINGERPRINT_PREFIX) for s in sa | sb | sc_)
    [only] = sa
    assert sc.router.tree.get(only)["turns"] == 4


async def test_anthropic_system_field_is_part_of_the_fingerprint(upstream, start_sidecar):
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_headers", identity={"fingerprint": True})
    msgs = [{"role": "user", "content": [{"type": "text", "text": "hello"}]}]
    await post(sc, orjson.dumps({"system": "A", "messages": msgs}), path="/v1/messages")
    await post(sc, orjson.dumps({"system": "B", "messages": msgs}), path="/v1/messages")
    await post(sc, orjson.dumps({"system": "A", "messages": msgs}), path="/v1/messages")
    got = sessions(upstream)
    assert got[0] == got[2] != got[1]
