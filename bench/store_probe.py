"""What proxy_bench.py's store case (i) reads besides wrk's numbers: the sidecar's counters from its
admin /metrics, and what the shared store holds, from the Redis server itself.

- :func:`counters`: the proxied requests and the store's round trips, commands and operations a
  sidecar counted so far; two readings around a run give that run's deltas.
- :class:`StoreProbe`: a Redis connection (redis-py, the sidecar's own client library) for the
  memory figures: ``INFO memory`` and ``MEMORY STATS`` for the whole store, ``MEMORY USAGE`` for a
  sample of session hashes and for the live-session sorted set.
"""

from __future__ import annotations

import http.client
import re
import statistics
from typing import Any

_SAMPLE = re.compile(r"^(\w+)(?:\{([^}]*)\})? (\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

# Counter names as the sidecar exports them (sidecar/metrics.py), and the keys they get here.
REQUESTS = "sidecar_requests_total"
ROUND_TRIPS = "sidecar_state_round_trips_total"
COMMANDS = "sidecar_state_commands_total"
OPS = "sidecar_state_ops_total"
LATENCY = "sidecar_state_latency_seconds"
DROPPED = "sidecar_state_dropped_writes_total"
STORE_UP = "sidecar_state_store_up"
LIVE = "sidecar_live_sessions"


def parse_metrics(text: str) -> dict[str, float]:
    """The figures of a Prometheus text exposition this case uses: ``requests`` (summed over every
    label set), ``round_trips``, ``commands``, ``dropped``, ``store_up``, ``live_sessions``,
    ``ops:<op>:<outcome>`` per store operation and ``latency_sum:<op>`` / ``latency_count:<op>``
    (seconds, round trips) from the latency histogram. A counter the process does not export (the
    memory store exports no store counters) reads 0."""
    out: dict[str, float] = {"requests": 0.0, "round_trips": 0.0, "commands": 0.0, "dropped": 0.0}
    simple = {
        ROUND_TRIPS: "round_trips",
        COMMANDS: "commands",
        DROPPED: "dropped",
        STORE_UP: "store_up",
        LIVE: "live_sessions",
    }
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.group(1), match.group(2) or "", float(match.group(3))
        if name == REQUESTS:
            out["requests"] += value
        elif name in simple:
            out[simple[name]] = value
        elif name == OPS:
            found = dict(_LABEL.findall(labels))
            key = f"ops:{found.get('op', '?')}:{found.get('outcome', '?')}"
            out[key] = out.get(key, 0.0) + value
        elif name in (LATENCY + "_sum", LATENCY + "_count"):
            op = dict(_LABEL.findall(labels)).get("op", "?")
            out[f"latency_{name.rsplit('_', 1)[1]}:{op}"] = value
    return out


def counters(host: str, admin_port: int, timeout: float = 10.0) -> dict[str, float]:
    """The sidecar's counters now (``parse_metrics`` of its admin /metrics)."""
    conn = http.client.HTTPConnection(host, admin_port, timeout=timeout)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200:
            raise OSError(f"GET /metrics answered {resp.status}")
    finally:
        conn.close()
    return parse_metrics(body.decode(errors="replace"))


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """``after - before`` per key (a key missing on one side counts 0); gauges are taken as of
    ``after``."""
    out = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after.keys() | before.keys()}
    for gauge in ("store_up", "live_sessions"):
        if gauge in after:
            out[gauge] = after[gauge]
    return out


class StoreError(OSError):
    """The Redis server did not answer a reading."""


def _answers(method: Any) -> Any:
    """A StoreProbe method whose Redis errors come out as StoreError."""
    import functools

    @functools.wraps(method)
    def wrapper(self: StoreProbe, *args: Any, **kwargs: Any) -> Any:
        import redis

        try:
            return method(self, *args, **kwargs)
        except redis.RedisError as exc:
            raise StoreError(f"redis: {exc}") from exc

    return wrapper


class StoreProbe:
    """A connection to the benchmark's Redis server, for its memory figures; its readings raise
    StoreError (an OSError) when the server does not answer."""

    def __init__(self, host: str, port: int) -> None:
        import redis  # the sidecar's dependency: present wherever the sidecar is installed

        self.client: Any = redis.Redis(host=host, port=port, decode_responses=True, socket_timeout=30)

    @_answers
    def ping(self) -> None:
        self.client.ping()

    @_answers
    def live_members(self, prefix: str) -> int:
        return int(self.client.zcard(prefix + "live"))

    def close(self) -> None:
        self.client.close()

    @_answers
    def version(self) -> str:
        return str(self.client.info("server").get("redis_version", "unknown"))

    @_answers
    def command_calls(self) -> dict[str, float]:
        """``INFO commandstats``: calls so far per command (``redis:<command>``; ``script|exists``
        for a subcommand), the commands scripts run included, and ``redis:all``, their sum."""
        out: dict[str, float] = {}
        for name, stats in self.client.info("commandstats").items():
            calls = float(stats.get("calls", 0)) if isinstance(stats, dict) else 0.0
            out["redis:" + name.removeprefix("cmdstat_")] = calls
        # (the harness's own INFO calls left out)
        out["redis:all"] = sum(v for k, v in out.items() if k != "redis:info")
        return out

    @_answers
    def snapshot(self, prefix: str) -> dict[str, Any]:
        """The whole store's memory now: ``used_memory``, the parts ``MEMORY STATS`` names (the
        main and expires hash tables of db 0, clients, scripts), the key count, and the live-session
        sorted set (``<prefix>live``): members and ``MEMORY USAGE`` over all of them."""
        info = self.client.info("memory")
        stats = _pairs(self.client.execute_command("MEMORY", "STATS"))
        db0 = _pairs(stats.get("db.0") or [])
        live = prefix + "live"
        return {
            "used_memory": int(info["used_memory"]),
            "dataset_bytes": int(stats.get("dataset.bytes", 0)),
            "hashtable_main": int(db0.get("overhead.hashtable.main", 0)),
            "hashtable_expires": int(db0.get("overhead.hashtable.expires", 0)),
            "clients_normal": int(stats.get("clients.normal", 0)),
            "lua_caches": int(stats.get("lua.caches", 0)),
            "keys": int(self.client.dbsize()),
            "live_members": int(self.client.zcard(live)),
            "live_usage": int(self.client.memory_usage(live, samples=0) or 0),
            "live_encoding": str(self.client.object("encoding", live) or ""),
        }

    @_answers
    def hash_usage(self, pattern: str, count: int) -> dict[str, Any]:
        """``MEMORY USAGE`` (all fields) of up to ``count`` keys matching ``pattern``: mean, min,
        max, the number sampled, their encoding and field count (of the first)."""
        keys: list[str] = []
        for key in self.client.scan_iter(match=pattern, count=1000):
            keys.append(key)
            if len(keys) >= count:
                break
        if not keys:
            return {"sampled": 0}
        sizes = [int(self.client.memory_usage(key, samples=0) or 0) for key in keys]
        return {
            "sampled": len(keys),
            "mean": round(statistics.fmean(sizes), 1),
            "min": min(sizes),
            "max": max(sizes),
            "encoding": str(self.client.object("encoding", keys[0]) or ""),
            "fields": int(self.client.hlen(keys[0])),
            "example": keys[0],
        }


def _pairs(flat: Any) -> dict[str, Any]:
    """A Redis reply of alternating names and values as a dict (MEMORY STATS comes that way, or
    already as a dict from a client that maps it)."""
    if isinstance(flat, dict):
        return flat
    items = list(flat)
    return {str(items[i]): items[i + 1] for i in range(0, len(items) - 1, 2)}
