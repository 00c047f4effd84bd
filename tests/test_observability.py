"""What operators read: the standard process / Python metrics and the build info on /metrics,
per-deployment session counters, and a startup line that names what actually runs."""

from __future__ import annotations

import logging
import re

import aiohttp
from prometheus_client import CollectorRegistry

import sidecar
from sidecar.app import Sidecar, _address
from sidecar.config import build_config


async def metrics_text(sc: Sidecar) -> str:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{sc.admin_url}/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


async def test_standard_collectors_and_build_info_on_every_apps_registry(upstream, start_sidecar, engine):
    # Two apps in one process: each registry gets its own collectors (no duplicate registration).
    first = await start_sidecar(upstream=upstream.url)
    second = await start_sidecar(upstream=upstream.url)
    for sc in (first, second):
        text = await metrics_text(sc)
        for name in (
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "python_gc_objects_collected_total",
            "python_info",
        ):
            assert re.search(rf"^{name}(\{{.*\}})? ", text, re.M), name
        labels = {"version": sidecar.__version__, "engine": engine, "compiled": str(sc.engine.compiled).lower()}
        assert sc.metrics.registry.get_sample_value("sidecar_build_info", labels) == 1.0
        assert len(re.findall(r"^sidecar_build_info\{", text, re.M)) == 1


async def test_session_counters_carry_the_deployment(upstream, start_sidecar):
    sc = await start_sidecar(
        deployments=[
            {"name": "chat", "upstreams": [upstream.url], "mode": "smg_routing_key"},
            {"name": "agents", "upstreams": [upstream.url], "mode": "dynamo_headers"},
        ]
    )
    async with aiohttp.ClientSession() as s:
        for deployment, session, path in [
            ("chat", "c1", "/worker?w=w1"),
            ("chat", "c1", "/worker?w=w1"),
            ("agents", "a1", "/x"),
        ]:
            async with s.get(
                f"{sc.proxy_url}{path}",
                headers={"X-Sidecar-Deployment": deployment, "X-Correlation-ID": session, "X-Session-Final": "true"},
            ) as resp:
                assert resp.status == 200
    reg = sc.metrics.registry
    assert (
        reg.get_sample_value("sidecar_headers_injected_total", {"deployment": "chat", "mode": "smg_routing_key"}) == 2
    )
    assert (
        reg.get_sample_value("sidecar_headers_injected_total", {"deployment": "agents", "mode": "dynamo_headers"}) == 1
    )
    assert reg.get_sample_value("sidecar_affinity_turns_total", {"deployment": "chat", "outcome": "first"}) == 2
    assert reg.get_sample_value("sidecar_affinity_turns_total", {"deployment": "agents", "outcome": "first"}) is None
    assert (
        reg.get_sample_value("sidecar_sessions_ended_total", {"deployment": "agents", "reason": "final_turn_completed"})
        == 1
    )
    assert (
        reg.get_sample_value("sidecar_sessions_ended_total", {"deployment": "chat", "reason": "final_turn_completed"})
        == 2
    )


async def test_startup_line_names_version_modes_upstreams_and_bound_addresses(upstream, engine, caplog):
    caplog.set_level(logging.INFO, logger="sidecar")
    url = upstream.url.replace("http://", "http://operator:pw-secret@")
    cfg = build_config(
        flags={
            "listen": "127.0.0.1:0",
            "admin": "127.0.0.1:0",
            "upstream": url,
            "mode": "dynamo_headers",
            "engine": engine,
        },
        env={},
    )
    sc = Sidecar(cfg, registry=CollectorRegistry())
    await sc.start()
    try:
        (line,) = [r for r in caplog.records if r.getMessage() == "sidecar started"]
        admin_port = sc.admin_url.rsplit(":", 1)[1]
        assert (line.version, line.engine, line.compiled) == (sidecar.__version__, engine, sc.engine.compiled)
        assert (line.listen, line.admin) == (f"127.0.0.1:{sc.engine.port}", f"127.0.0.1:{admin_port}")
        assert line.deployments == [{"name": "default", "mode": "dynamo_headers", "upstreams": [upstream.url]}]
        assert "pw-secret" not in str(line.__dict__)
    finally:
        await sc.stop()


def test_bound_addresses_are_logged_as_bound():
    assert _address("0.0.0.0", 8080) == "0.0.0.0:8080"  # all interfaces, not a loopback URL
    assert _address("::", 9091) == "[::]:9091"
    assert _address("10.1.2.3", 80) == "10.1.2.3:80"
