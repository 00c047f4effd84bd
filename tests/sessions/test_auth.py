"""Access control of the sessions API: workspaces, admin tokens, 401s, and the startup refusal."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from sidecar.config import build_config
from sidecar.errors import ConfigError
from tests.sessions.support import TOKEN_A, TOKEN_ADMIN, TOKEN_B, Api, deployment, fetch_spec, tokens_file, write_yaml
from tests.upstream import RecordingUpstream

UP = "http://127.0.0.1:9"


async def two_workspaces(launch_api, http, upstream_url: str = UP):
    sc = await launch_api(
        deployments=[deployment("agents", upstream_url, strict=True, mode="dynamo_headers")],
        readiness_check_upstream=False,
        admin_tokens_file=tokens_file(),
    )
    spec = await fetch_spec(http, sc.admin_url)
    return (
        sc,
        Api(http, sc.admin_url, spec, TOKEN_A),
        Api(http, sc.admin_url, spec, TOKEN_B),
        Api(http, sc.admin_url, spec, TOKEN_ADMIN),
        Api(http, sc.admin_url, spec),
    )


async def test_missing_or_invalid_token_is_401(launch_api, http):
    sc, _, _, _, anon = await two_workspaces(launch_api, http)
    for call in (anon.list(), anon.create(deployment="agents"), anon.get("x"), anon.close("x"), anon.tree("x")):
        status, err = await call
        assert status == 401 and err["error"]["type"] == "unauthorized"
    for value in ("Bearer wrong-token-0000000000", "Basic dXNlcjpwYXNz", "Bearer", TOKEN_A):
        async with http.get(sc.admin_url + "/v1/sessions", headers={"Authorization": value}) as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"].startswith('Bearer realm="sidecar"')


async def test_health_metrics_openapi_need_no_token(launch_api, http):
    sc, *_ = await two_workspaces(launch_api, http)
    for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
        async with http.get(sc.admin_url + path) as resp:
            assert resp.status == 200, path
    spec = await fetch_spec(http, sc.admin_url)
    assert spec.doc["paths"]["/v1/sessions"]["get"]["security"] == [{"bearerAuth": []}]
    assert spec.doc["paths"]["/healthz"]["get"]["security"] == []


async def test_workspaces_are_isolated_and_admin_sees_all(launch_api, http, upstream: RecordingUpstream):
    sc, a, b, admin, _ = await two_workspaces(launch_api, http, upstream.url)
    _, sa = await a.create(deployment="agents", session_id="ws-a:sess-a")
    _, sb = await b.create(deployment="agents", session_id="ws-b:sess-b")
    assert sa["workspace"] == "ws-a" and sb["workspace"] == "ws-b"
    # another workspace's session answers exactly like an unknown one
    status, err = await b.get("ws-a:sess-a")
    unknown_status, unknown = await b.get("ws-a:sess-x")
    assert status == unknown_status == 404 and err["error"]["type"] == "session_not_found"
    assert err["error"]["message"] == unknown["error"]["message"]
    status, err = await b.close("ws-a:sess-a")
    assert status == 404
    assert (await a.get("ws-a:sess-a"))[1]["status"] == "active"  # untouched by ws-b's attempt
    assert [s["id"] for s in (await a.list())[1]["data"]] == ["ws-a:sess-a"]
    assert [s["id"] for s in (await b.list())[1]["data"]] == ["ws-b:sess-b"]
    assert [s["id"] for s in (await admin.list())[1]["data"]] == ["ws-a:sess-a", "ws-b:sess-b"]
    assert (await admin.get("ws-b:sess-b"))[0] == 200
    # a parent must be the caller's own session
    status, err = await b.create(deployment="agents", parent="ws-a:sess-a")
    assert status == 404 and err["error"]["type"] == "parent_not_found"
    # trees: visible to the workspace owning the root, and to admins
    async with http.get(sc.proxy_url + "/x", headers={"X-Correlation-ID": "ws-a:sess-a"}) as resp:
        assert resp.status == 200
    assert (await a.tree("ws-a:sess-a"))[0] == 200
    assert (await b.tree("ws-a:sess-a"))[0] == 404
    assert (await admin.tree("ws-a:sess-a"))[0] == 200
    # the admin closes anyone's session
    status, closed = await admin.close("ws-b:sess-b")
    assert status == 200 and closed["status"] == "closed"
    assert (await b.get("ws-b:sess-b"))[1]["status"] == "closed"


async def test_workspace_tokens_choose_ids_in_their_own_namespace(launch_api, http, upstream: RecordingUpstream):
    sc, a, b, admin, _ = await two_workspaces(launch_api, http, upstream.url)
    assert (await a.create(deployment="agents", session_id="ws-a:mine"))[0] == 201
    assert (await a.create(deployment="agents", session_id="ws-a:mine"))[0] == 409  # its own id: taken
    for sid in ("mine", "ws-a", "ws-a:", "ws-ab:x", "WS-A:x", "x:ws-a:y"):
        status, err = await a.create(deployment="agents", session_id=sid)
        assert status == 400 and err["error"]["type"] == "invalid_request", sid
        assert "'ws-a:'" in err["error"]["message"]
    # admin tokens choose any id, inside a workspace's namespace too
    assert (await admin.create(deployment="agents", session_id="free-id"))[0] == 201
    assert (await admin.create(deployment="agents", session_id="ws-b:made-by-admin"))[0] == 201
    # generated ids are unchanged
    status, generated = await b.create(deployment="agents")
    assert status == 201 and ":" not in generated["id"]


async def test_creating_a_session_reveals_nothing_about_other_workspaces(launch_api, http, upstream: RecordingUpstream):
    sc = await launch_api(
        deployments=[
            deployment("chat", upstream.url, mode="dynamo_headers"),
            deployment("agents", upstream.url, strict=True),
        ],
        readiness_check_upstream=False,
        admin_tokens_file=tokens_file(),
    )
    spec = await fetch_spec(http, sc.admin_url)
    a, b, admin = (Api(http, sc.admin_url, spec, token) for token in (TOKEN_A, TOKEN_B, TOKEN_ADMIN))
    assert (await a.create(deployment="agents", session_id="ws-a:secret"))[0] == 201
    assert (await admin.create(deployment="agents", session_id="admin-made"))[0] == 201
    async with http.get(sc.proxy_url + "/x", headers={"X-Correlation-ID": "ws-a:learned"}) as resp:
        assert resp.status == 200
    async with http.get(sc.proxy_url + "/x", headers={"X-Correlation-ID": "learned"}) as resp:
        assert resp.status == 200
    # existing ids (ws-a's, an admin's, learned from traffic) and unknown ones answer alike
    answers = []
    for sid in ("ws-a:secret", "ws-a:unknown", "admin-made", "admin-unknown", "ws-a:learned", "learned", "never-seen"):
        async with http.post(
            sc.admin_url + "/v1/sessions", headers=b.headers, json={"deployment": "agents", "session_id": sid}
        ) as resp:
            answers.append((resp.status, await resp.read()))
    assert answers[0][0] == 400 and answers.count(answers[0]) == len(answers), answers
    assert b"ws-a" not in answers[0][1] and b"secret" not in answers[0][1]


async def test_traffic_sessions_visible_to_admin_only(launch_api, http, upstream: RecordingUpstream):
    sc = await launch_api(
        deployments=[deployment("chat", upstream.url, mode="dynamo_headers")],
        readiness_check_upstream=False,
        admin_tokens_file=tokens_file(),
    )
    spec = await fetch_spec(http, sc.admin_url)
    async with http.get(sc.proxy_url + "/x", headers={"X-Correlation-ID": "learned"}) as resp:
        assert resp.status == 200
    assert (await Api(http, sc.admin_url, spec, TOKEN_A).get("learned"))[0] == 404
    status, view = await Api(http, sc.admin_url, spec, TOKEN_ADMIN).get("learned")
    assert status == 200 and view["origin"] == "traffic" and view["workspace"] is None


async def test_tokens_never_logged(launch_api, http, caplog):
    caplog.set_level(logging.DEBUG)
    sc, a, *_ = await two_workspaces(launch_api, http)
    await a.create(deployment="agents")
    async with http.get(sc.admin_url + "/v1/sessions", headers={"Authorization": "Bearer guessed-token-123456"}):
        pass
    for tok in (TOKEN_A, TOKEN_B, TOKEN_ADMIN, "guessed-token-123456"):
        assert tok not in caplog.text


def test_non_loopback_admin_without_tokens_refused():
    flags = {"upstream": UP, "admin": "0.0.0.0:9091"}
    with pytest.raises(ConfigError, match="admin_insecure"):
        build_config(flags=flags, env={})
    assert build_config(flags=flags, env={"SIDECAR_ADMIN_INSECURE": "true"}).admin_insecure
    assert build_config(flags={**flags, "config": write_yaml({"admin_tokens_file": tokens_file()})}, env={})
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--upstream", UP, "--admin", "0.0.0.0:0", "--listen", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=30,
        env={},
    )
    assert result.returncode == 2 and "admin_insecure" in result.stderr


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ({"tokens": []}, "at least one token"),
        ({"tokens": [{"token": "short", "workspace": "ws"}]}, "tokens[0].token"),
        ({"tokens": [{"token": "long-enough-token-1234"}]}, "needs a workspace or admin"),
        ({"tokens": [{"token": "long-enough-token-1234", "workspace": "bad space"}]}, "tokens[0].workspace"),
        (
            {
                "tokens": [
                    {"token": "long-enough-token-1234", "admin": True},
                    {"token": "long-enough-token-1234", "admin": True},
                ]
            },
            "duplicate",
        ),
        ({"keys": []}, "one key, `tokens`"),
    ],
)
def test_bad_tokens_file_names_the_entry_never_the_token(content, needle):
    with pytest.raises(ConfigError) as info:
        build_config(flags={"upstream": UP, "config": write_yaml({"admin_tokens_file": write_yaml(content)})}, env={})
    assert needle in str(info.value) and "long-enough-token-1234" not in str(info.value)
