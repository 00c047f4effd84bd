"""The per-deployment ``tls`` settings: checked when the config loads, errors naming the setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry

from sidecar.config import build_config
from sidecar.deployments import Deployment
from sidecar.errors import ConfigError
from sidecar.metrics import Metrics
from tests.tls.conftest import Pki

HTTPS = "https://gateway.test:8443"


def load(tmp_path: Path, data: dict[str, Any]) -> Any:
    f = tmp_path / "config.yaml"
    f.write_text(yaml.safe_dump(data))
    return build_config(env={}, file=f)


def deployment(**keys: Any) -> dict[str, Any]:
    return {"deployments": [{"name": "gw", "upstreams": [HTTPS], **keys}]}


def refused(tmp_path: Path, data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, data)
    return str(info.value)


def test_https_upstreams_are_accepted_by_the_fast_engine(tmp_path):
    cfg = load(tmp_path, {"upstream": HTTPS})
    assert cfg.engine == "fast"
    assert cfg.normalized()["deployments"][0]["tls"] is None


def test_tls_settings_are_normalized(tmp_path, pki: Pki):
    cfg = load(tmp_path, deployment(tls={"ca_file": pki.ca_file, "server_name": "gw.internal"}))
    assert cfg.normalized()["deployments"][0]["tls"] == {
        "ca_file": pki.ca_file,
        "cert_file": None,
        "key_file": None,
        "server_name": "gw.internal",
        "verify": True,
    }


def test_missing_ca_file_names_the_setting(tmp_path):
    message = refused(tmp_path, deployment(tls={"ca_file": str(tmp_path / "nope.pem")}))
    assert message == f"deployments[0].tls.ca_file: cannot read {tmp_path / 'nope.pem'}: No such file or directory"


def test_ca_file_without_a_certificate(tmp_path):
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert refused(tmp_path, deployment(tls={"ca_file": str(junk)})) == (
        f"deployments[0].tls.ca_file: {junk} holds no PEM certificate (NO_CERTIFICATE_OR_CRL_FOUND)"
    )


def test_cert_and_key_come_together(tmp_path, pki: Pki):
    assert refused(tmp_path, deployment(tls={"cert_file": pki.cert_file})) == (
        "deployments[0].tls.key_file: required with cert_file (a client certificate needs its private key)"
    )
    assert refused(tmp_path, deployment(tls={"key_file": pki.key_file})) == (
        "deployments[0].tls.cert_file: required with key_file (a client certificate needs its private key)"
    )


def test_key_must_match_the_certificate(tmp_path, pki: Pki):
    message = refused(tmp_path, deployment(tls={"cert_file": pki.cert_file, "key_file": pki.other_key_file}))
    assert message == (
        f"deployments[0].tls.key_file: {pki.other_key_file} is not the private key of cert_file {pki.cert_file}"
    )


def test_unreadable_key_and_bad_certificate(tmp_path, pki: Pki):
    assert refused(tmp_path, deployment(tls={"cert_file": pki.cert_file, "key_file": str(tmp_path)})) == (
        f"deployments[0].tls.key_file: cannot read {tmp_path}: Is a directory"
    )
    assert refused(tmp_path, deployment(tls={"cert_file": pki.key_file, "key_file": pki.key_file})).startswith(
        f"deployments[0].tls.cert_file: {pki.key_file} holds no PEM certificate"
    )


def test_encrypted_key_is_refused_without_prompting(tmp_path, pki: Pki):
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(Path(pki.key_file).read_bytes(), None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
    )
    assert refused(tmp_path, deployment(tls={"cert_file": pki.cert_file, "key_file": str(encrypted)})) == (
        "deployments[0].tls.key_file: the private key is encrypted; give it unencrypted "
        "(as a Kubernetes TLS Secret holds it)"
    )


def test_tls_on_an_http_upstream_is_an_error(tmp_path, pki: Pki):
    data = {
        "deployments": [{"name": "gw", "upstreams": [HTTPS, "http://10.0.0.2:8000"], "tls": {"ca_file": pki.ca_file}}]
    }
    assert refused(tmp_path, data) == (
        "deployments[0].tls: applies to https:// upstreams only; deployments[0].upstreams[1] is http://"
    )
    assert refused(tmp_path, {"upstream": "http://10.0.0.2:8000", "tls": {"verify": False}}) == (
        "tls: applies to https:// upstreams only; upstream is http://"
    )


def test_unknown_and_malformed_tls_settings(tmp_path):
    assert refused(tmp_path, deployment(tls={"verfy": False})) == "deployments[0].tls.verfy: unknown setting"
    assert refused(tmp_path, deployment(tls={"server_name": "gw internal"})).startswith(
        "deployments[0].tls.server_name: String should match pattern"
    )


def test_short_form_names_the_top_level_setting(tmp_path):
    assert refused(tmp_path, {"upstream": HTTPS, "tls": {"ca_file": "/nonexistent/ca.pem"}}) == (
        "tls.ca_file: cannot read /nonexistent/ca.pem: No such file or directory"
    )


def test_check_config_exits_2_naming_the_setting(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(yaml.safe_dump(deployment(tls={"ca_file": "/nonexistent/ca.pem"})))
    result = subprocess.run(
        [sys.executable, "-m", "sidecar", "check-config", str(f)], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 2
    assert "deployments[0].tls.ca_file: cannot read /nonexistent/ca.pem: No such file or directory" in result.stderr


def test_one_context_per_deployment_shared_by_its_upstreams(tmp_path, pki: Pki):
    cfg = load(
        tmp_path,
        {
            "deployments": [
                {
                    "name": "a",
                    "upstreams": [HTTPS, "https://gateway2.test"],
                    "tls": {"ca_file": pki.ca_file, "server_name": "gw.internal"},
                },
                {"name": "b", "upstreams": [HTTPS], "tls": {"ca_file": pki.ca_file, "verify": False}},
                {"name": "c", "upstreams": ["http://10.0.0.3:8000"]},
            ]
        },
    )
    stats = Metrics(CollectorRegistry()).for_deployment
    a, b, c = (Deployment.from_config(d, stats=stats) for d in cfg.resolved_deployments())
    assert a.upstreams[0].tls_context is a.upstreams[1].tls_context is not None
    assert [u.server_hostname for u in a.upstreams] == ["gw.internal", "gw.internal"]
    assert b.upstreams[0].tls_context is not a.upstreams[0].tls_context
    assert b.upstreams[0].server_hostname is None  # SNI and the checked name: the URL's host
    assert b.upstreams[0].tls_context.verify_mode.name == "CERT_NONE"
    assert a.upstreams[0].pool_key != b.upstreams[0].pool_key  # same URL, other TLS: never one pool
    assert (c.upstreams[0].tls_context, c.upstreams[0].pool_key) == (None, "http://10.0.0.3:8000")


def test_the_shared_stores_files_are_checked_at_load_naming_the_setting(tmp_path, pki: Pki):
    up = {"upstream": "http://127.0.0.1:1"}
    missing = str(tmp_path / "nope")
    assert (
        refused(tmp_path, {**up, "state": {"url": "redis://127.0.0.1:6379", "password_file": missing}})
        == f"state.password_file: cannot read {missing}: No such file or directory"
    )
    assert refused(tmp_path, {**up, "state": {"password_file": missing}}) == (
        "state.password_file: applies to a shared store only; state.url is memory://"
    )
    assert refused(tmp_path, {**up, "state": {"url": "redis://127.0.0.1:6379", "ca_file": pki.ca_file}}) == (
        "state.ca_file: applies to rediss:// URLs only; state.url is redis://"
    )
    assert (
        refused(tmp_path, {**up, "state": {"url": "rediss://127.0.0.1:6379", "ca_file": missing}})
        == f"state.ca_file: cannot read {missing}: No such file or directory"
    )
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    assert refused(tmp_path, {**up, "state": {"url": "rediss://127.0.0.1:6379", "ca_file": str(junk)}}).startswith(
        f"state.ca_file: {junk} holds no PEM certificate"
    )
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    cfg = load(
        tmp_path,
        {**up, "state": {"url": "rediss://127.0.0.1:6379", "ca_file": pki.ca_file, "password_file": str(password)}},
    )
    assert cfg.state.ca_file == pki.ca_file and cfg.state.password_file == str(password)
