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
from sidecar.compiled import is_compiled
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


# The peer of wake_round_trip: echoes each byte it reads until it reads "q" or its input ends.
_ECHO = """
import os, sys
os.sched_setaffinity(0, {int(sys.argv[1])})
while (b := os.read(0, 1)) and b != b"q":
    os.write(1, b)
"""


def wake_round_trip(cpu: int, peer_cpu: int, samples: int = 400, idle_s: float = 0.002) -> dict[str, float]:
    """How long waking a sleeping process on another core takes here: the round trip of one
    byte from this process (on ``cpu`` for the measurement) to an echo process on ``peer_cpu``
    that has slept ``idle_s`` since the last one. p50, p99 and max in microseconds, over
    ``samples`` round trips (about ``samples * idle_s`` seconds).

    On bare metal this is tens of microseconds. A hypervisor that takes an idle virtual CPU off
    its physical core makes it hundreds, with a tail of milliseconds, and then every proxy's
    latency through sleeping cores (time to first event, 1-connection p50) carries that noise."""
    own = os.sched_getaffinity(0)
    peer = subprocess.Popen([sys.executable, "-c", _ECHO, str(peer_cpu)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert peer.stdin is not None and peer.stdout is not None
    out, back = peer.stdin.fileno(), peer.stdout.fileno()
    times: list[int] = []
    try:
        os.sched_setaffinity(0, {cpu})
        os.write(out, b"x")  # the peer is up once it answers
        os.read(back, 1)
        for _ in range(samples):
            time.sleep(idle_s)
            start = time.perf_counter_ns()
            os.write(out, b"x")
            os.read(back, 1)
            times.append(time.perf_counter_ns() - start)
    finally:
        os.sched_setaffinity(0, own)
        with contextlib.suppress(OSError):
            os.write(out, b"q")
        peer.stdin.close()
        peer.stdout.close()
        try:
            peer.wait(5)
        except subprocess.TimeoutExpired:
            peer.kill()
            peer.wait()
    times.sort()
    return {
        "p50_us": round(times[len(times) // 2] / 1e3, 1),
        "p99_us": round(times[min(len(times) - 1, int(0.99 * len(times)))] / 1e3, 1),
        "max_us": round(times[-1] / 1e3, 1),
        "samples": len(times),
    }


def machine_facts(wake_cores: tuple[int, int] | None = None) -> dict[str, Any]:
    """Where and what ran: for the header of a result file and its JSON. With ``wake_cores``
    (the cores a benchmark pins its two sides to), also :func:`wake_round_trip` between them,
    where this process may run on both."""
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
    if wake_cores is not None and set(wake_cores) <= os.sched_getaffinity(0):
        facts["wake_round_trip"] = {"cores": list(wake_cores), **wake_round_trip(*wake_cores)}
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
    if wake := facts.get("wake_round_trip"):
        rows.append(
            (
                f"waking a sleeping process, core {wake['cores'][0]} to {wake['cores'][1]} and back",
                f"p50 {wake['p50_us']:,.0f} us, p99 {wake['p99_us']:,.0f} us, max {wake['max_us']:,.0f} us"
                f" ({wake['samples']} round trips, bench/record.py wake_round_trip)",
            )
        )
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
