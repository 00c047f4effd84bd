"""Per-request cost of a body mode's body work, on one core, without sockets.

    python bench/body_cost.py [--size 1024] [--seconds 1.0]

Runs the `dynamo_nvext` body path as the router runs it (scan the body, splice the patch in)
and, for comparison, the parse-and-serialize path it replaced (orjson.loads, merge, dumps), on
the chat-completions body of bench/wrk/post.lua padded to --size bytes. Also the whole
``Router.transform_body`` of a `dynamo_nvext` deployment (admission and session tree included).
Prints microseconds per request for the build it runs in (``SIDECAR_PURE_PYTHON=1`` for the
pure-Python one). Best of 5 runs: the machine's noise only ever adds time.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

from sidecar import jsonscan  # noqa: E402
from sidecar.config import build_config  # noqa: E402
from sidecar.context import TurnOutcome  # noqa: E402
from sidecar.jsonbody import scan_body, splice  # noqa: E402
from sidecar.metrics import Metrics  # noqa: E402
from sidecar.router import WORK, RequestHead  # noqa: E402
from sidecar.wiring import routing_core  # noqa: E402

PATH = ("nvext", "session_control")
OWNED = ("session_id", "action", "timeout")
CONTROL = {"session_id": "00000000-bench-4000-8000-000000000001", "action": "bind", "timeout": 300}


def chat_body(size: int) -> bytes:
    head = b'{"model":"bench","max_tokens":16,"stream":false,"messages":[{"role":"user","content":"'
    tail = b'"}]}'
    return head + b"x" * max(0, size - len(head) - len(tail)) + tail


def parse_and_dump(body: bytes) -> bytes:
    """The replaced path: parse, merge into nvext.session_control (copy on write), serialize."""
    obj = orjson.loads(body)
    nvext = obj.get("nvext")
    out = dict(obj)
    if nvext is None:
        out["nvext"] = {"session_control": dict(CONTROL)}
    else:
        nvext = dict(nvext) if isinstance(nvext, dict) else {}
        old = nvext.get("session_control")
        merged = {k: v for k, v in old.items() if k not in OWNED} if isinstance(old, dict) else {}
        merged.update(CONTROL)
        nvext["session_control"] = merged
        out["nvext"] = nvext
    return orjson.dumps(out)


def scan_and_splice(body: bytes) -> bytes:
    return splice(scan_body(body, 128, (b"nvext",)), PATH, dict(CONTROL), OWNED)


def per_call(fn: Callable[[], Any], seconds: float) -> float:
    """Microseconds per call: best of 5 runs of about ``seconds`` / 5 each."""
    n = 1
    while True:  # calibrate
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if time.perf_counter() - t > 0.02:
            break
        n *= 2
    runs = max(1, int(seconds / 5 / (time.perf_counter() - t) * n))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(runs):
            fn()
        best = min(best, (time.perf_counter() - t) / runs)
    return best * 1e6


def router_path() -> Callable[[bytes], Any]:
    # protocol bind: every turn carries the whole patch, as in earlier results.
    flags = {"upstream": "http://127.0.0.1:9", "mode": "dynamo_nvext", "mode_opt": ["protocol=bind"]}
    cfg = build_config(flags=flags, env={})
    router = routing_core(cfg, Metrics(CollectorRegistry()))
    head = RequestHead("POST", {"x-correlation-id": "bench-session", "content-length": "1024"})

    def run(body: bytes) -> Any:
        adm = router.admit(head)
        adm.body(body, len(body))
        while adm.need == WORK and adm.work is not None:  # (a large body: what an engine runs on its body pool)
            adm.worked(adm.work())
        adm.finish(TurnOutcome.COMPLETED)
        return adm.decision.body if adm.decision is not None else None

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    body = chat_body(args.size)
    assert orjson.loads(scan_and_splice(body)) == orjson.loads(parse_and_dump(body))
    through_router = router_path()
    assert orjson.loads(through_router(body))["nvext"]["session_control"]["action"] == "bind"
    build = "compiled" if jsonscan.COMPILED else "pure-python"
    print(f"{build} build, {len(body)}-byte body, us per request (best of 5):")
    rows = [
        ("parse + merge + dumps (replaced)", lambda: parse_and_dump(body)),
        ("scan + splice", lambda: scan_and_splice(body)),
        ("  scan only", lambda: scan_body(body, 128, (b"nvext",))),
        ("Router.route + transform_body + finish", lambda: through_router(body)),
    ]
    for label, fn in rows:
        print(f"  {label:<42} {per_call(fn, args.seconds):8.2f}")


if __name__ == "__main__":
    main()
