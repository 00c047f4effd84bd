"""Command line: ``sidecar run | check-config | modes | demo``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import Any

import yaml

from sidecar import __version__

EXIT_CONFIG = 2


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sidecar", description="Session-routing sidecar for LLM inference gateways.")
    p.add_argument("--version", action="version", version=f"sidecar {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser(
        "run",
        help="run the proxy",
        description="Run the proxy. Precedence: flags > SIDECAR_* environment > --config file > defaults.",
    )
    run.add_argument(
        "--listen", metavar="HOST:PORT", help="proxy listener (env SIDECAR_LISTEN; default 127.0.0.1:8080)"
    )
    run.add_argument("--upstream", metavar="URL", help="gateway base URL (env SIDECAR_UPSTREAM)")
    run.add_argument("--mode", metavar="NAME", help="routing mode (env SIDECAR_MODE; see `sidecar modes`)")
    run.add_argument(
        "--mode-opt",
        metavar="KEY=VALUE",
        action="append",
        dest="mode_opt",
        help="mode option, repeatable (env SIDECAR_MODE_OPTS=k=v,k2=v2)",
    )
    run.add_argument("--admin", metavar="HOST:PORT", help="admin listener (env SIDECAR_ADMIN; default 127.0.0.1:9091)")
    run.add_argument("--engine", choices=("fast", "aiohttp"), help="HTTP engine (env SIDECAR_ENGINE)")
    run.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        dest="log_level",
        help="log level (env SIDECAR_LOG_LEVEL; default info)",
    )
    run.add_argument(
        "--state",
        metavar="URL",
        help="session state: memory:// (default) or redis://HOST:PORT shared by replicas (env SIDECAR_STATE)",
    )
    run.add_argument("--config", metavar="FILE", help="YAML config file (env SIDECAR_CONFIG)")

    check = sub.add_parser(
        "check-config",
        help="validate the configuration in effect and print it normalized",
        description="Validate the configuration `run` would start with (FILE, else SIDECAR_CONFIG, with the "
        "SIDECAR_* environment on top) and print it normalized; exit 2 naming the bad setting.",
    )
    check.add_argument(
        "file",
        metavar="FILE",
        nargs="?",
        help="YAML config file (default: SIDECAR_CONFIG; none: the environment alone)",
    )

    sub.add_parser("modes", help="list routing modes with their options and defaults")

    demo = sub.add_parser(
        "demo",
        help="run a multi-turn workload against an embedded mock gateway, "
        "directly and through the sidecar, and compare",
        description="Start, in this process on loopback, a mock gateway with 4 workers that routes like Dynamo "
        "(a session header pins a session to its worker) and keeps a per-worker prefix cache; run the same "
        "streamed multi-turn workload directly and through the sidecar; print both side by side (worker "
        "switches within sessions, cached / prompt tokens, latency) and the latency the sidecar adds. Exit 0 "
        "when both runs had no errors and no session moved between workers through the sidecar, else 1.",
    )
    demo.add_argument(
        "--sessions", type=int, default=16, metavar="N", help="concurrent conversations (default %(default)s)"
    )
    demo.add_argument(
        "--turns", type=int, default=5, metavar="N", help="streamed turns per conversation (default %(default)s)"
    )
    return p


def _fail(message: str) -> int:
    print(f"sidecar: invalid configuration:\n{message}", file=sys.stderr)
    return EXIT_CONFIG


def cmd_run(args: argparse.Namespace) -> int:
    from sidecar import logs
    from sidecar.app import serve
    from sidecar.config import build_config
    from sidecar.errors import ConfigError
    from sidecar.fdlimit import raise_open_file_limit
    from sidecar.state import StoreUnavailable

    flags = {
        k: getattr(args, k)
        for k in ("listen", "upstream", "mode", "mode_opt", "admin", "engine", "log_level", "state", "config")
    }
    try:
        config = build_config(flags=flags)
    except ConfigError as exc:
        return _fail(str(exc))
    logs.setup(config.log_level)
    raise_open_file_limit()
    try:
        _run_loop(serve(config))
    except OSError as exc:  # typically a listener address already in use
        print(
            f"sidecar: cannot start: {exc.strerror or exc} (listen {config.listen}, admin {config.admin})",
            file=sys.stderr,
        )
        return 1
    except StoreUnavailable as exc:  # state.required, and the store cannot be used
        print(f"sidecar: cannot start: {exc}", file=sys.stderr)
        return 1
    return 0


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
        return asyncio.run(coro)
    return uvloop.run(coro)


def cmd_check_config(args: argparse.Namespace) -> int:
    from sidecar.config import build_config
    from sidecar.errors import ConfigError

    try:
        config = build_config(file=args.file)  # the SIDECAR_* environment applies, as for `run`
    except ConfigError as exc:
        return _fail(str(exc))
    sys.stdout.write(yaml.safe_dump(config.normalized(), sort_keys=False))
    return 0


def cmd_modes(args: argparse.Namespace) -> int:
    from sidecar.modes.registry import available, load_mode

    for name in available():
        cls = load_mode(name)
        doc = (cls.__doc__ or sys.modules[cls.__module__].__doc__ or "").strip().splitlines()
        body = " (mutates the request body)" if cls.mutates_body else ""
        print(f"{name}{body}")
        if doc:
            print(f"    {doc[0]}")
        fields = cls.Options.model_fields
        if not fields:
            print("    options: none")
        for fname, field in fields.items():
            default = "required" if field.is_required() else f"default {field.get_default(call_default_factory=True)!r}"
            ann = _type_name(field.annotation)
            desc = f" - {field.description}" if field.description else ""
            print(f"    {fname}: {ann}, {default}{desc}")
    return 0


def _type_name(tp: Any) -> str:
    """``Literal['a', 'b']`` -> ``a|b``, ``list[str]`` -> ``list of str``, ``int`` -> ``int``."""
    import typing

    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (list, tuple, set, frozenset):
        return f"list of {_type_name(args[0])}" if args else "list"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def cmd_demo(args: argparse.Namespace) -> int:
    from sidecar.demo import run_demo

    result = _run_loop(run_demo(sessions=args.sessions, turns=args.turns))
    return 0 if result.ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = {"run": cmd_run, "check-config": cmd_check_config, "modes": cmd_modes, "demo": cmd_demo}[args.command]
    return handler(args)
