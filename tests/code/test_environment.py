"""Every SIDECAR_* variable this repository sets or reads (product, image, chart, manifests,
scripts, tests, benchmarks) is one the sidecar accepts, so that the check refusing unknown ones
(sidecar.config.unknown_env_problems) never refuses a real one; and the variables of the
repository's own tooling are never read by the product."""

from __future__ import annotations

import re
from pathlib import Path

from sidecar.config import ENV_PREFIX, OUTSIDE_CONFIG_ENV, REMOVED, TOOLING_ENV, config_env_names, unknown_env_problems

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"\bSIDECAR_[A-Z0-9_]*[A-Z0-9]\b")
# These two hold misspelled names on purpose.
EXAMPLES_OF_TYPOS = {ROOT / "tests" / "config" / "test_environment.py", Path(__file__).resolve()}


def sources() -> list[Path]:
    found = [ROOT / "setup.py", ROOT / "Dockerfile", ROOT / "pyproject.toml"]
    for top, patterns in {
        "sidecar": ("*.py", "*.pyx", "*.pxd", "*.js", "*.html"),
        "deploy": ("*.yaml", "*.yml", "*.tpl", "*.json", "*.txt"),
        "scripts": ("*.sh", "*.py"),
        "tests": ("*.py",),
        "bench": ("*.py", "*.sh", "*.lua"),
        "config": ("*.yaml",),
        ".ci": ("*",),
    }.items():
        for pattern in patterns:
            found.extend(p for p in (ROOT / top).rglob(pattern) if p.is_file())
    return [p for p in found if p.resolve() not in EXAMPLES_OF_TYPOS]


def test_every_variable_used_in_the_repository_is_accepted() -> None:
    used: dict[str, Path] = {}
    for path in sources():
        for name in NAME.findall(path.read_text(encoding="utf-8", errors="replace")):
            used.setdefault(name, path)
    assert "SIDECAR_STATE_PASSWORD" in used and "SIDECAR_UPSTREAM" in used  # the scan sees them
    removed = {ENV_PREFIX + key.upper() for key in REMOVED}  # tests show they are refused
    refused = {
        name: str(path.relative_to(ROOT))
        for name, path in used.items()
        if name not in removed and unknown_env_problems({name: "1"})
    }
    assert refused == {}


def test_tooling_variables_are_not_product_settings() -> None:
    assert not set(TOOLING_ENV) & (set(config_env_names()) | set(OUTSIDE_CONFIG_ENV))
    readers = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "sidecar").rglob("*.py")
        if any(name in path.read_text(encoding="utf-8") for name in TOOLING_ENV)
    }
    assert readers == {"sidecar/config.py"}  # the list of names it ignores, nothing that reads one
