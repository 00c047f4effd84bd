"""The sidecar's other clients of an https:// upstream use the deployment's TLS settings too:
end-of-session actions and active health checks."""

from __future__ import annotations

import aiohttp

from tests.tls.conftest import Pki
from tests.waiting import wait_for


def mtls(pki: Pki) -> dict[str, str]:
    return {"ca_file": pki.ca_file, "cert_file": pki.cert_file, "key_file": pki.key_file}


async def test_end_of_session_action_uses_the_deployments_tls(pki, tls_recording_upstream, start_sidecar):
    """vllm_router's /finish_session reaches an upstream that requires the client certificate."""
    up = await tls_recording_upstream(pki.server_context(client_cert="required"))
    sc = await start_sidecar(upstream=up.url, mode="vllm_router", readiness_check_upstream=False, tls=mtls(pki))
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{sc.proxy_url}/v1/chat/completions",
            data=b"{}",
            headers={"X-Correlation-ID": "s1", "X-Session-Final": "true"},
        ) as resp:
            assert resp.status == 200
    await wait_for(lambda: any(r.path.startswith("/finish_session") for r in up.received))
    assert [r.path for r in up.received] == ["/v1/chat/completions", "/finish_session?session_id=s1"]
    await wait_for(
        lambda: (
            sc.metrics.registry.get_sample_value("sidecar_end_actions_total", {"mode": "vllm_router", "outcome": "ok"})
            == 1
        )
    )


async def test_health_checks_use_the_deployments_tls(pki, tls_recording_upstream, start_sidecar):
    """Both upstreams serve /health; only the one whose certificate verifies is healthy."""
    good = await tls_recording_upstream(pki.server_context(client_cert="required"))
    bad = await tls_recording_upstream(pki.server_context(cert="named"))  # not valid for 127.0.0.1
    sc = await start_sidecar(
        readiness_check_upstream=False,
        deployments=[
            {
                "name": "default",
                "upstreams": [good.url, bad.url],
                "tls": mtls(pki),
                "health_check": {"path": "/health", "interval_seconds": 0.05, "timeout_seconds": 1},
            }
        ],
    )
    dep = sc.router.deployments[0]
    await wait_for(lambda: not dep.balancer.is_healthy(dep.upstreams[1]))
    await wait_for(lambda: len([r for r in good.received if r.path == "/health"]) >= 2)
    assert dep.balancer.is_healthy(dep.upstreams[0])
    assert bad.received == []  # the handshake failed: no request reached it
