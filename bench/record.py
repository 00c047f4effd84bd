"""Dated result files for the benchmarks: what ran, where, and what it measured.

Each run writes ``bench/results/<YYYY-MM-DD>-<benchmark>-<commit>.md`` (the tables under a
header of machine facts: CPU model, cores, kernel, Python, whether the sidecar ran compiled, the
commit and whether the tree had uncommitted changes, the exact command line) and a ``.json`` of
the same name with the raw numbers. ``<commit>`` is the short hash, with ``-dirty`` when tracked
or new files outside bench/results differed from it; a second run on the same day and commit
gets ``-2``, ``-3``, ... rather than overwriting the first. See bench/results/README.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

# Modules that setup.py compiles (each has a .pxd beside it): all of them or none run compiled,
# unless the build is broken.
_COMPILED_PROBE = """
import importlib, json
from sidecar.engine import is_compiled
names = ["sidecar.lineage", "sidecar.router", "sidecar.engine.fast", "sidecar.engine.head"]
print(json.dumps({n: is_compiled(importlib.import_module(n)) for n in names}))
"""


def _git(*args: str) -> str:
    out = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=30)
    return out.stdout.rstrip("\n") if out.returncode == 0 else ""  # porcelain lines start with a space


def sidecar_build(python: str = sys.executable) -> str:
    """'compiled', 'pure Python' or 'partly compiled (...)', for ``python`` with this
    environment (SIDECAR_PURE_PYTHON=1 runs the sources even where compiled modules exist)."""
    with contextlib.suppress(Exception):
        out = subprocess.run([python, "-c", _COMPILED_PROBE], capture_output=True, text=True, timeout=60, cwd=REPO)
        flags: dict[str, bool] = json.loads(out.stdout)
        if all(flags.values()):
            return "compiled"
        if not any(flags.values()):
            return "pure Python"
        return "partly compiled (" + ", ".join(n for n, c in flags.items() if c) + ")"
    return "unknown"


def machine_facts() -> dict[str, Any]:
    """Where and what ran: for the header of a result file and its JSON."""
    facts: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z")}
    facts["command"] = shlex.join(
        [
            os.path.relpath(sys.executable, Path.cwd()) if sys.executable.startswith(str(REPO)) else sys.executable,
            *sys.argv,
        ]
    )
    facts["cwd"] = str(Path.cwd())
    facts["commit"] = _git("rev-parse", "--short", "HEAD").strip() or "unknown"
    changed = _git("status", "--porcelain", "--", ".", ":(exclude)bench/results")
    facts["dirty"] = bool(changed)
    if changed:
        facts["dirty_files"] = [line[3:] for line in changed.splitlines()][:50]
    with contextlib.suppress(OSError):
        model = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text())
        facts["cpu"] = model.group(1).strip() if model else "unknown"
    facts["cores"] = os.cpu_count()
    facts["kernel"] = platform.release()
    facts["python"] = platform.python_version()
    facts["sidecar_build"] = sidecar_build()
    facts["environment"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith("SIDECAR_")}
    facts["load_average_at_start"] = os.getloadavg()[0]
    return facts


def fact_lines(facts: dict[str, Any]) -> list[str]:
    """The machine facts as a two-column Markdown table."""
    commit = facts["commit"] + (
        " (uncommitted changes: " + ", ".join(facts.get("dirty_files", [])) + ")" if facts["dirty"] else " (clean tree)"
    )
    env = ", ".join(f"{k}={v}" for k, v in facts["environment"].items()) or "none"
    rows = [
        ("date", facts["date"]),
        ("command", f"`{facts['command']}`"),
        ("commit", commit),
        ("CPU", f"{facts.get('cpu', 'unknown')}, {facts['cores']} cores"),
        ("kernel", facts["kernel"]),
        ("Python", facts["python"]),
        ("sidecar build", facts["sidecar_build"]),
        ("SIDECAR_* environment", env),
        ("load average at start", f"{facts['load_average_at_start']:.2f}"),
    ]
    return ["| | |", "|---|---|", *(f"| {k} | {cell(str(v))} |" for k, v in rows)]


def cell(text: str) -> str:
    """``text`` made safe for one Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def result_paths(benchmark: str, facts: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """The next free ``<date>-<benchmark>-<commit>[-dirty][-n]`` pair of paths in ``out_dir``."""
    stem = f"{facts['date'][:10]}-{benchmark}-{facts['commit']}{'-dirty' if facts['dirty'] else ''}"
    n = 1
    while True:
        name = stem if n == 1 else f"{stem}-{n}"
        md, js = out_dir / f"{name}.md", out_dir / f"{name}.json"
        if not md.exists() and not js.exists():
            return md, js
        n += 1


def write(
    benchmark: str, title: str, body: str, raw: dict[str, Any], facts: dict[str, Any], out_dir: Path = RESULTS
) -> tuple[Path, Path]:
    """Write the dated Markdown and JSON of one run; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    md, js = result_paths(benchmark, facts, out_dir)
    md.write_text("\n".join([f"# {title}", "", *fact_lines(facts), "", body.rstrip(), ""]))
    js.write_text(json.dumps({"benchmark": benchmark, "facts": facts, **raw}, indent=1) + "\n")
    return md, js
