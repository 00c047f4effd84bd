"""Modes are plugins: an out-of-tree package registers through entry-point metadata, and the
plugin contract (declared body work, failures attributed to the mode) is enforced."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from sidecar.config import build_config
from sidecar.errors import ConfigError
from sidecar.jsonscan import INLINE_BYTES
from sidecar.modes import registry
from sidecar.modes.base import Mode, ModeContractError, check_contract
from tests.modes.wire import drive, plan

PLUGIN_MODULE = "acme_sidecar_modes"
PLUGIN_SOURCE = textwrap.dedent('''
    """A third-party package of sidecar modes, as it would ship on PyPI."""
    from pydantic import BaseModel, ConfigDict

    from sidecar.modes.base import BodyPatch, Mode


    class AcmeOptions(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        tag: str = "acme"


    class AcmeHeader(Mode):
        """X-Acme-Route: <tag>:<root>."""

        name = "acme_header"
        Options = AcmeOptions

        def emitted_headers(self):
            return ("X-Acme-Route",)

        def request_headers(self, ctx):
            return (("X-Acme-Route", f"{self.options.tag}:{ctx.root}:{ctx.turn}"),)


    class RequestBoom(Mode):
        name = "acme_request_boom"

        def request_headers(self, ctx):
            raise RuntimeError("kaboom")


    class BodyBoom(Mode):
        name = "acme_body_boom"
        mutates_body = True

        def transform_body(self, ctx, body):
            raise KeyError("no such field")


    class BodyTag(Mode):
        """Adds "tag": <session> to the parsed body."""
        name = "acme_body_tag"
        mutates_body = True

        def transform_body(self, ctx, body):
            return {**body, "tag": ctx.session}


    class DeepResult(Mode):
        """Returns a body nested deeper than orjson serializes."""
        name = "acme_deep_result"
        mutates_body = True

        def transform_body(self, ctx, body):
            out = body
            for _ in range(300):
                out = {"x": out}
            return out


    class PatchBad(Mode):
        """A patch whose value cannot be serialized."""
        name = "acme_patch_bad"
        mutates_body = True

        def body_patch(self, ctx):
            return BodyPatch(("acme",), {"v": {1, 2}})


    class PatchWrongType(Mode):
        name = "acme_patch_wrong_type"
        mutates_body = True

        def body_patch(self, ctx):
            return {"path": ("acme",)}


    class PatchEmptyPath(Mode):
        name = "acme_patch_empty_path"
        mutates_body = True

        def body_patch(self, ctx):
            return BodyPatch((), {"v": 1})


    class PatchListPath(Mode):
        name = "acme_patch_list_path"
        mutates_body = True

        def body_patch(self, ctx):
            return BodyPatch(["acme"], {"v": 1})


    class PatchIntKey(Mode):
        name = "acme_patch_int_key"
        mutates_body = True

        def body_patch(self, ctx):
            return BodyPatch((1,), {"v": 1})


    class UndeclaredPatch(Mode):
        name = "acme_undeclared_patch"

        def body_patch(self, ctx):
            return None


    class BothBodyHooks(Mode):
        name = "acme_both_body_hooks"
        mutates_body = True

        def body_patch(self, ctx):
            return None

        def transform_body(self, ctx, body):
            return body


    class EndBoom(Mode):
        name = "acme_end_boom"

        def request_headers(self, ctx):
            return (("X-Acme-Seen", ctx.session),)

        def on_session_end(self, end):
            raise RuntimeError("end hook failed")


    class UndeclaredBody(Mode):
        name = "acme_undeclared_body"

        def transform_body(self, ctx, body):
            return body


    class DeclaredButNoBody(Mode):
        name = "acme_declared_no_body"
        mutates_body = True


    class Reframer(Mode):
        """Tries to set the message's framing."""
        name = "acme_reframer"

        def request_headers(self, ctx):
            return (("Content-Length", "0"),)


    class Injector(Mode):
        """Puts the session id into a value with a line break in it."""
        name = "acme_injector"

        def request_headers(self, ctx):
            return (("X-Acme", ctx.session + "\\r\\nTransfer-Encoding: chunked"),)
''')
ENTRY_POINTS = textwrap.dedent(f"""
    [sidecar.modes]
    acme_header = {PLUGIN_MODULE}:AcmeHeader
    acme_request_boom = {PLUGIN_MODULE}:RequestBoom
    acme_body_boom = {PLUGIN_MODULE}:BodyBoom
    acme_body_tag = {PLUGIN_MODULE}:BodyTag
    acme_deep_result = {PLUGIN_MODULE}:DeepResult
    acme_patch_bad = {PLUGIN_MODULE}:PatchBad
    acme_patch_wrong_type = {PLUGIN_MODULE}:PatchWrongType
    acme_patch_empty_path = {PLUGIN_MODULE}:PatchEmptyPath
    acme_patch_list_path = {PLUGIN_MODULE}:PatchListPath
    acme_patch_int_key = {PLUGIN_MODULE}:PatchIntKey
    acme_undeclared_patch = {PLUGIN_MODULE}:UndeclaredPatch
    acme_both_body_hooks = {PLUGIN_MODULE}:BothBodyHooks
    acme_end_boom = {PLUGIN_MODULE}:EndBoom
    acme_undeclared_body = {PLUGIN_MODULE}:UndeclaredBody
    acme_declared_no_body = {PLUGIN_MODULE}:DeclaredButNoBody
    acme_reframer = {PLUGIN_MODULE}:Reframer
    acme_injector = {PLUGIN_MODULE}:Injector
""")


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Install the plugin package into a directory on sys.path (module + dist-info metadata)."""
    site = tmp_path / "site"
    dist = site / "acme_sidecar_modes-0.1.dist-info"
    dist.mkdir(parents=True)
    (site / f"{PLUGIN_MODULE}.py").write_text(PLUGIN_SOURCE)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-sidecar-modes\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(site))
    registry.refresh()
    yield site
    sys.modules.pop(PLUGIN_MODULE, None)
    monkeypatch.undo()
    registry.refresh()


def test_plugin_is_listed_beside_the_builtins(plugin: Path) -> None:
    names = registry.available()
    assert {
        "acme_header",
        "dynamo_headers",
        "dynamo_nvext",
        "smg_routing_key",
        "session_id_header",
        "identity_headers",
    } <= set(names)
    assert registry.load_mode("acme_header").__module__ == PLUGIN_MODULE


def test_plugin_options_are_validated_like_builtin_ones(plugin: Path) -> None:
    flags = {"upstream": "http://127.0.0.1:9", "mode": "acme_header", "mode_opt": ["tagg=x"]}
    with pytest.raises(ConfigError, match=r"^mode_options\.tagg: unknown setting$"):
        build_config(flags=flags, env={})


async def test_plugin_mode_from_config_reaches_the_upstream(plugin: Path, upstream, start_sidecar) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="acme_header", mode_opt=["tag=blue"])
    steps = plan([("p-root", None), ("p-child", "p-root")], [0, 1, 0, 1, 1, 0])
    await drive(sc, steps, b"{}", extra={"X-Acme-Route": "spoof"})
    assert [r.all("X-Acme-Route") for r in upstream.received] == [
        ["blue:p-root:1"],
        ["blue:p-root:1"],
        ["blue:p-root:2"],
        ["blue:p-root:2"],
        ["blue:p-root:3"],
        ["blue:p-root:3"],
    ]


def test_contract_refuses_undeclared_body_hook_at_startup(plugin: Path) -> None:
    for name, needle in [
        ("acme_undeclared_body", "overrides transform_body but does not declare mutates_body"),
        ("acme_undeclared_patch", "overrides body_patch but does not declare mutates_body"),
        ("acme_declared_no_body", "declares mutates_body = True but does not override"),
        ("acme_both_body_hooks", "overrides both body_patch and transform_body"),
    ]:
        flags = {"upstream": "http://127.0.0.1:9", "mode": name}
        with pytest.raises((ConfigError, ModeContractError), match=f"{name}.*{needle}"):
            build_config(flags=flags, env={})


@pytest.mark.parametrize("name", ["acme_undeclared_body", "acme_declared_no_body"])
def test_check_config_refuses_contract_breaking_mode_with_exit_2(plugin: Path, tmp_path: Path, name: str) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump({"upstream": "http://127.0.0.1:9", "mode": name}))
    proc = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(f)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PYTHONPATH": str(plugin)},
    )
    assert proc.returncode == 2, proc.stderr
    assert "mode:" in proc.stderr and name in proc.stderr and "mutates_body" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_contract_directly() -> None:
    class Sneaky(Mode):
        name = "sneaky"

        def transform_body(self, ctx, body):  # type: ignore[no-untyped-def]
            return body

    class Lazy(Mode):
        name = "lazy"
        mutates_body = True

    class Nameless(Mode):
        pass

    class Both(Mode):
        name = "both"
        mutates_body = True

        def body_patch(self, ctx):  # type: ignore[no-untyped-def]
            return None

        def transform_body(self, ctx, body):  # type: ignore[no-untyped-def]
            return body

    class Patcher(Mode):
        name = "patcher"
        mutates_body = True

        def body_patch(self, ctx):  # type: ignore[no-untyped-def]
            return None

    with pytest.raises(ModeContractError, match="'sneaky' overrides transform_body"):
        check_contract(Sneaky)
    with pytest.raises(ModeContractError, match="'lazy' declares mutates_body"):
        check_contract(Lazy)
    with pytest.raises(ModeContractError, match="'both' overrides both body_patch and transform_body"):
        check_contract(Both)
    assert check_contract(Patcher) is Patcher
    with pytest.raises(ModeContractError, match="has no `name`"):
        check_contract(Nameless)
    with pytest.raises(ModeContractError, match="not a subclass"):
        check_contract(dict)


@pytest.mark.parametrize(
    "mode,hook",
    [
        ("acme_request_boom", "request_headers"),
        ("acme_body_boom", "transform_body"),
        ("acme_reframer", "request_headers"),
        ("acme_injector", "request_headers"),
        ("acme_deep_result", "transform_body"),
        ("acme_patch_bad", "body_patch"),
        ("acme_patch_wrong_type", "body_patch"),
        ("acme_patch_empty_path", "body_patch"),
        ("acme_patch_list_path", "body_patch"),
        ("acme_patch_int_key", "body_patch"),
    ],
)
@pytest.mark.parametrize("size", ["small", "large"])
async def test_failing_request_hook_is_a_mode_error_naming_the_mode(
    plugin: Path, upstream, start_sidecar, mode: str, hook: str, size: str
) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode=mode)
    # A large body's body work runs on a worker thread: failures there are the mode's too.
    body = b'{"model": "m"}' if size == "small" else b'{"model": "m", "pad": "' + b"x" * 2 * INLINE_BYTES + b'"}'
    async with aiohttp.ClientSession() as client:
        async with client.post(
            sc.proxy_url + "/v1/chat/completions", data=body, headers={"X-Correlation-ID": "s-1"}
        ) as resp:
            status, body = resp.status, orjson.loads(await resp.read())
    assert status == 500
    err = body["error"]
    assert err["type"] == "mode_error"
    assert err["mode"] == mode
    assert mode in err["message"] and hook in err["message"]
    assert "upstream" not in err["message"].lower()
    assert upstream.received == []
    registry_ = sc.metrics.registry
    assert registry_.get_sample_value("sidecar_plugin_errors_total", {"mode": mode, "hook": hook}) == 1
    # The failed request does not leave its session in flight.
    assert sc.router.tree.get("s-1") is None or sc.router.tree.get("s-1")["in_flight"] == 0


async def test_failing_end_hook_is_counted_and_later_sessions_still_end(plugin: Path, upstream, start_sidecar) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="acme_end_boom")
    reg = sc.metrics.registry
    steps = plan([("e-1", None), ("e-2", None), ("e-3", None)], [0, 0, 1, 1, 2, 2], turns=2)
    await drive(sc, steps, b"{}")
    assert [r.all("X-Acme-Seen") for r in upstream.received] == [["e-1"], ["e-1"], ["e-2"], ["e-2"], ["e-3"], ["e-3"]]
    assert reg.get_sample_value("sidecar_plugin_errors_total", {"mode": "acme_end_boom", "hook": "on_session_end"}) == 3
    assert (
        reg.get_sample_value(
            "sidecar_sessions_ended_total", {"deployment": "default", "reason": "final_turn_completed"}
        )
        == 3
    )
    assert reg.get_sample_value("sidecar_live_sessions") == 0
    # And the proxy keeps serving.
    await drive(sc, plan([("e-4", None)], [0], turns=1), b"{}")
    assert upstream.received[-1].all("X-Acme-Seen") == ["e-4"]
    assert reg.get_sample_value("sidecar_plugin_errors_total", {"mode": "acme_end_boom", "hook": "on_session_end"}) == 4


# -- dynamo_nvext with bodies that are not JSON objects ------------------------------------

NON_OBJECT = [
    (b"[1,2]", "passthrough_not_object"),
    (b' "text" ', "passthrough_not_object"),
    (b"null", "passthrough_not_object"),
    (b'{"model": "m",', "passthrough_invalid_json"),
    (b"\xff\xfe not json", "passthrough_invalid_json"),
]


@pytest.mark.parametrize("body,outcome", NON_OBJECT)
async def test_non_object_body_passes_through_and_is_counted(
    upstream, start_sidecar, body: bytes, outcome: str
) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="dynamo_nvext", mode_opt=["timeout_seconds=123"])
    await drive(sc, plan([("n-1", None)], [0, 0], turns=2), body)
    assert [r.body for r in upstream.received] == [body, body]
    reg = sc.metrics.registry
    assert reg.get_sample_value("sidecar_body_rewrites_total", {"mode": "dynamo_nvext", "outcome": outcome}) == 2
    assert reg.get_sample_value("sidecar_body_rewrites_total", {"mode": "dynamo_nvext", "outcome": "rewritten"}) is None


@pytest.mark.parametrize("body", [b"[1,2]", b'{"model": "m",'])
async def test_non_object_body_rejected_when_the_deployment_says_so(upstream, start_sidecar, body: bytes) -> None:
    sc = await start_sidecar(
        upstream=upstream.url, mode="dynamo_nvext", mode_opt=["protocol=bind"], non_object_body="reject"
    )
    async with aiohttp.ClientSession() as client:
        async with client.post(
            sc.proxy_url + "/v1/chat/completions",
            data=body,
            headers={"X-Correlation-ID": "r-1", "Content-Type": "application/json"},
        ) as resp:
            status, payload = resp.status, orjson.loads(await resp.read())
        # An object body on the same deployment is still rewritten.
        async with client.post(
            sc.proxy_url + "/v1/chat/completions", data=b'{"model":"m"}', headers={"X-Correlation-ID": "r-2"}
        ) as resp:
            assert resp.status == 200
    assert status == 400
    assert payload["error"]["type"] == "invalid_json_body"
    assert "dynamo_nvext" in payload["error"]["message"]
    assert len(upstream.received) == 1
    assert upstream.received[0].json() == {
        "model": "m",
        "nvext": {"session_control": {"session_id": "r-2", "action": "bind", "timeout": 300}},
    }
    reg = sc.metrics.registry
    assert reg.get_sample_value("sidecar_body_rewrites_total", {"mode": "dynamo_nvext", "outcome": "rejected"}) == 1


@pytest.mark.parametrize("size", ["small", "large"])
async def test_transform_body_modes_get_the_body_parsed_and_their_result_serialized(
    plugin: Path, upstream, start_sidecar, size: str
) -> None:
    sc = await start_sidecar(upstream=upstream.url, mode="acme_body_tag")
    pad = "" if size == "small" else "x" * 2 * INLINE_BYTES
    body = b'{"model": "m", "pad": "' + pad.encode() + b'", "n": 1e2}'
    await drive(sc, plan([("t-1", None)], [0], turns=1), body)
    assert upstream.received[0].body == orjson.dumps({"model": "m", "pad": pad, "n": 100.0, "tag": "t-1"})
    # Valid JSON orjson does not parse (a number beyond a double) passes unchanged, counted.
    await drive(sc, plan([("t-2", None)], [0], turns=1), b'{"n": 1e400}')
    assert upstream.received[1].body == b'{"n": 1e400}'
    reg = sc.metrics.registry
    assert (
        reg.get_sample_value(
            "sidecar_body_rewrites_total", {"mode": "acme_body_tag", "outcome": "passthrough_invalid_json"}
        )
        == 1
    )
