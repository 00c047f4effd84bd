"""The shared backend: sessions in Redis 7+ or Valkey, so several replicas act as one and sessions
survive restarts (``state.url: redis://...``). Data layout and the atomic steps are in
:mod:`sidecar.state.scripts`; records in :mod:`sidecar.state.records`.

How it keeps the request path free of round trips:

- **Loads**: a request of a session this replica does not hold waits for one pipelined read of
  the session, its parent and its root hint (:meth:`RedisState.load`); every load asked in the
  same loop iteration shares that round trip. What it finds is placed in the router's tree and
  API table (the cache), so the session's root, binding and upstream are the fleet's.
- **Writes behind**: turns report to a dirty table (a dict operation). Every ``flush_interval_ms``
  the new sessions, changes of this replica's requests in flight (holders), closes and mode
  states go out in one script call; turn counts and activity once a second. A replica killed with
  SIGKILL loses at most those intervals of its own writes.
- **Ends, exactly once**: a local end (final turn, API close) marks the session closing in the
  store and publishes it; every replica stops admitting it and, when its own requests of it
  drained, asks the store to end it. The store ends it once the settle window (a few flush
  intervals: every holder is written by then) passed and no live replica holds a request of it,
  for exactly one caller, who runs the end-of-session actions. Idle expiry and the live-session
  cap are swept in the store by whichever replica's sweep claims them first.
- **Claims survive lost replies**: the store records which replica claimed an end; until that
  replica confirms it ran the end (after its end actions), a retry or a later sweep of the same
  replica is handed the claim again, and once the claimer's lease expired (it died) another
  replica's sweep is. A replica runs a claim it is already running once.
- **Faults**: a failed or slow store call opens a circuit breaker: the request that met it waited
  at most ``timeout_ms``, later ones do not wait at all and go on with local state. The admin
  listener's calls use a connection pool of their own with a longer timeout
  (:data:`ADMIN_TIMEOUT_SECONDS`), do not depend on the breaker and answer their caller's
  failure alone: they never open it. The breaker is probed off the request path, by the writer task (1 s, doubling to
  30 s), with a script and TIME: a store must be usable, not only reachable, and its clock is
  the fleet's (:meth:`RedisState.wall`). Once the store answers, pending writes go out and every
  live session held here is republished (it fills records the store lost, with this replica's
  requests in flight and turn count, never lowering what the store has). A store that lost its
  data (its epoch changed) is republished to the same way. The dirty table is bounded; what an
  overflow drops (the oldest first, in O(1)) is counted.
- **Events**: closes and ends arrive through a subscription, which is pinged when silent: one
  that does not answer (a connection a NAT or conntrack entry silently dropped) is replaced and
  every session held here is checked against the store. The writes' replies report closes too,
  so a replica learns of one with its next write of the session even without events.
- **Untrusted records**: a record that does not decode is an error for that session only: its
  requests are served on local state, it is logged once, and no request waits on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import ssl
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import AuthenticationError, NoPermissionError, NoScriptError, RedisError

from sidecar.config import Config
from sidecar.context import EndReason, SessionEnd, SessionFlag
from sidecar.identity import Identity
from sidecar.lineage import SHARED_FLAGS, SessionTree, Turn
from sidecar.metrics import Metrics
from sidecar.session_ends import SessionEnds
from sidecar.sessions import ApiSession, SessionStatus, SessionStore
from sidecar.state import SessionState, StoreUnavailable
from sidecar.state import scripts as lua
from sidecar.state.records import BadRecord, Record, decode, ms

log = logging.getLogger("sidecar.state")

LAZY_SECONDS = 1.0  # turn counts and activity
CLOCK_SYNC_SECONDS = 10.0  # how often the store's clock is read again (see RedisState.wall)
SWEEP_BATCH = 500
LEASE_SECONDS = 10  # a replica's holders count while its lease lives (refreshed every lazy flush)
BREAKER_MIN, BREAKER_MAX = 1.0, 30.0
MAX_DIRTY = 200_000  # sessions with unwritten changes; beyond it the oldest are dropped (counted)
REPUBLISH_BATCH = 1000
MAX_CHILDREN_READ = 1000  # child ids a view reads of one session (a children set may hold millions)
# Records an admin read decodes per round trip: the decoding runs on the event loop the proxy
# shares, between two awaits, so each such run stays short (about a millisecond).
READ_STEP = 128
KEY_GRACE_SECONDS = 60
# The admin listener's calls (views, the sessions API) wait this long for the store: they are off
# the request path, and a view of a large tree is a large read on a loaded store.
ADMIN_TIMEOUT_SECONDS = 5.0
# A silent subscription is pinged after this long, and replaced when the ping is not answered
# within EVENTS_DEAF_SECONDS (a connection that stays open but delivers nothing).
EVENTS_PING_SECONDS = 1.0
EVENTS_DEAF_SECONDS = 5.0
MAX_LOGGED_BAD = 1024  # unreadable records logged once each, up to this many ids remembered


class _Dirty:
    """A session's changes since its last write: what was written then, what is new since."""

    __slots__ = ("node", "turns0", "in_flight0", "flags0", "created", "mode", "workers", "usage")

    def __init__(self, node: Any, turns0: int, in_flight0: int, created: bool) -> None:
        self.node = node  # the tree's node (sidecar.lineage.SessionNode): its fields are read at write time
        self.turns0 = turns0
        self.in_flight0 = in_flight0
        self.flags0 = node.flags
        self.created = created
        self.mode = False
        self.workers = False
        # prompt-cache accounting not written yet, as increments (prompt, cached, turns with
        # usage, unknown turns); None: nothing
        self.usage: list[int] | None = None


class _Written:
    """What one write carried for a session: the node's counts as read, and the flags it took."""

    __slots__ = ("node", "full", "turns", "in_flight", "flags", "created", "mode", "workers", "usage")

    def __init__(
        self, node: Any, full: bool, turns: int, in_flight: int, flags: int, created: bool, mode: bool, workers: bool
    ) -> None:
        self.node, self.full, self.turns, self.in_flight, self.flags = node, full, turns, in_flight, flags
        self.created, self.mode, self.workers = created, mode, workers
        self.usage: list[int] | None = None  # the accounting increments it took


class RedisState(SessionState):
    """Sessions shared through Redis / Valkey (see the module docstring)."""

    shared = True

    def __init__(
        self,
        config: Config,
        metrics: Metrics,
        tree: SessionTree,
        api: SessionStore,
        ends: SessionEnds,
        *,
        clock: Any = time.time,
    ) -> None:
        super().__init__(config, ends)
        sc = config.state
        self.config = sc
        self.prefix = sc.key_prefix
        self.channel = self.prefix + "ev"
        self.timeout = sc.timeout_ms / 1000
        self._admin_timeout = max(ADMIN_TIMEOUT_SECONDS, self.timeout)
        self.tick = sc.flush_interval_ms / 1000
        # A holder reaches the store within a tick and two writes (one may be running when the
        # request starts; a write that takes longer than the timeout fails and opens the
        # breaker): an end waits this long after the close before it may be claimed, so every
        # request admitted before a replica heard of the close is counted.
        self.settle_ms = 2 * sc.timeout_ms + 2 * sc.flush_interval_ms
        s = config.sessions
        self.idle_ttl = s.idle_ttl_seconds
        self.cap = s.max_live_sessions
        self.tomb_ttl = int(max(s.tombstone_ttl_seconds, s.api.tombstone_ttl_seconds, 60))
        self.api_cfg = s.api
        self.metrics = metrics
        self.tree = tree
        self.api = api
        self.clock = clock
        # The store's clock minus this replica's (seconds), measured with TIME at start and then
        # every CLOCK_SYNC_SECONDS: every time written to or compared in the store is the
        # store's (:meth:`wall`), so replicas whose clocks disagree agree on deadlines.
        self._offset = 0.0
        self._next_sync = 0.0
        self.replica = uuid.uuid4().hex[:12]
        self.client: aioredis.Redis | None = None
        self.admin_client: aioredis.Redis | None = None
        self.up = False
        self._retry_at = 0.0
        self._backoff = BREAKER_MIN
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # Sessions with unwritten changes, oldest first (an overflow drops from the front: O(1)).
        self._dirty: OrderedDict[str, _Dirty] = OrderedDict()
        self._urgent: set[str] = set()
        self._ending: dict[str, str] = {}  # id -> reason: local ends to close and claim
        self._checks: dict[str, float] = {}  # id -> loop time: end checks to run again
        self._republish: list[str] = []
        # Claims (id -> token) this replica is running (their end actions not done yet), and the
        # ones it ran and has yet to confirm in the store (op K of the next write).
        self._running: dict[str, str] = {}
        self._acks: dict[str, str] = {}
        self._epoch: str | None = None  # the store's epoch as last seen: a change means data lost
        self._bad_logged: OrderedDict[str, None] = OrderedDict()
        # Response ids remembered here and not written yet: id -> "<deployment> <session>".
        self._response_writes: dict[str, str] = {}
        self._next_lazy = 0.0
        self._kicked = False
        self._stopping = False
        self._flushing: asyncio.Lock | None = None
        # loads waiting for the next batch
        self._batch: set[str] = set()
        self._batch_future: asyncio.Future[dict[str, Record | None]] | None = None
        self._batch_identities: list[Any] = []
        self._events = 0
        self.dropped = 0
        metrics.watch_state()
        m = metrics
        self._up_gauge = m.state_up
        self._op_counts = m.state_ops
        self._latency = m.state_latency
        self._dropped = m.state_dropped
        self._round_trips = m.state_round_trips
        self._commands = m.state_commands

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._flushing = asyncio.Lock()
        self.client = self._connect(self.timeout)
        self.admin_client = self._connect(self._admin_timeout)
        self._hello_script = self.client.register_script(lua.HELLO)
        self._flush_script = self.client.register_script(lua.FLUSH)
        self._close_script = self.client.register_script(lua.CLOSE)
        self._end_script = self.client.register_script(lua.END_CHECK)
        self._sweep_script = self.client.register_script(lua.SWEEP)
        self._create_script = self.client.register_script(lua.API_CREATE)
        try:
            await self._check(quiet_ms=0)
        except (RedisError, OSError, TimeoutError) as exc:
            if self.config.required:
                await self._close_clients()
                raise StoreUnavailable(
                    f"state.url: the shared store cannot be used ({_reason(exc)}{_hint(exc)}) and state.required is true"
                ) from None
            self._failed("start", exc)
        else:
            self._set_up(True)
            log.info("shared session store connected", extra={"replica": self.replica, "prefix": self.prefix})
            await self._check_eviction()
        loop = self._loop
        self._tasks = [
            loop.create_task(self._flusher(), name="sidecar-state-flush"),
            loop.create_task(self._listener(), name="sidecar-state-events"),
        ]

    async def stop(self) -> None:
        # The loops also check the flag: a cancellation that lands while a store call times out
        # can come back as the timeout (asyncio.timeout), which the loops would swallow.
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            done, _ = await asyncio.wait(list(self._tasks), timeout=2 * self.timeout + 1)
            for task in done:
                if not task.cancelled() and task.exception() is not None:
                    log.error("shared store task failed", exc_info=task.exception())
        if self.client is None:
            return
        if self.up:
            # The last writes (confirmations of the ends run here included); then the lease goes,
            # so that the fleet takes over at once any claim this replica did not get to run.
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self._flush(everything=True, claims=False)
                await self._timed("lease", self.client.delete(self.prefix + "rep:" + self.replica), commands=1)
        await self._close_clients()

    async def _close_clients(self) -> None:
        for client in (self.client, self.admin_client):
            if client is not None:
                await client.aclose()

    def _connect(self, timeout: float) -> aioredis.Redis:
        sc = self.config
        # No retries inside the client: a failure reaches the breaker at once.
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "decode_responses": True,
            "encoding_errors": "surrogateescape",
            "retry_on_timeout": False,
            "retry": Retry(NoBackoff(), 0),
        }
        password = os.environ.get("SIDECAR_STATE_PASSWORD")
        if sc.password_file:
            with open(sc.password_file, encoding="utf-8") as f:
                password = f.read().strip()
        if password:
            kwargs["password"] = password
        if sc.url.startswith("rediss:") and sc.ca_file:
            kwargs["ssl_ca_certs"] = sc.ca_file
        return aioredis.from_url(sc.url, **kwargs)

    # -- the breaker ---------------------------------------------------------------------------

    def _set_up(self, up: bool) -> None:
        self.up = up
        self._up_gauge.set(1.0 if up else 0.0)
        if up:
            self._backoff = BREAKER_MIN

    def _failed(self, op: str, exc: BaseException) -> None:
        """A store call failed: open the breaker (log once per outage)."""
        if self.up or op == "start":
            log.warning(
                "shared session store unreachable (%s: %s%s): serving on local state, retrying",
                op,
                _reason(exc),
                _hint(exc),
                extra={"replica": self.replica},
            )
        self._set_up(False)
        assert self._loop is not None
        self._retry_at = self._loop.time() + self._backoff
        self._backoff = min(self._backoff * 2, BREAKER_MAX)

    async def _probe(self) -> bool:
        """Closed breaker: True. Open: check the store (:meth:`_check`) when the backoff
        elapsed; on success close it and republish what this replica holds. Only the writer
        task probes: no proxied request waits for a store the breaker found down."""
        if self.up:
            return True
        assert self._loop is not None and self.client is not None
        if self._loop.time() < self._retry_at:
            return False
        try:
            await self._check(quiet_ms=lua.QUIET_MS)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("ping", exc)
            return False
        self._set_up(True)
        log.info("shared session store reachable again: republishing live sessions", extra={"replica": self.replica})
        self._republish = self.tree.held_sessions()
        return True

    async def _check(self, *, quiet_ms: int) -> None:
        """Prove the store usable, not only reachable (a user the store's ACL lets PING but not
        run scripts would otherwise pass, then fail every write): read its clock, then run a
        script that reads the store's epoch (creating it, with ``quiet_ms``, when missing)."""
        await self._sync_clock()
        (epoch,) = await self._scripts("ping", [(self._hello_script, [self.prefix, ms(self.wall()), quiet_ms])])
        self._saw_epoch(str(epoch))

    def _saw_epoch(self, epoch: str) -> None:
        """The store's epoch as a script returned it: a new one means the store lost its data
        (a restart without persistence, a flush): every live session held here goes to it again,
        with this replica's requests in flight and turn counts."""
        if self._epoch is not None and epoch != self._epoch:
            log.warning(
                "the shared session store lost its data: republishing the live sessions held here",
                extra={"replica": self.replica},
            )
            self._republish = self.tree.held_sessions()
        self._epoch = epoch

    async def _check_eviction(self) -> None:
        """Warn when the store may evict session state under memory pressure (every key here has
        a TTL, so a ``volatile-*`` policy evicts live sessions as readily as ``allkeys-*``)."""
        assert self.client is not None
        try:
            info = await self._timed("ping", self.client.info("memory"), commands=1)
        except (RedisError, OSError, TimeoutError):
            return  # (a user without INFO: nothing to check with; the docs say what to set)
        policy = str(info.get("maxmemory_policy", "noeviction"))
        if policy != "noeviction":
            log.warning(
                "the shared session store's maxmemory-policy is %s: under memory pressure it evicts live "
                "sessions (their ends and closes are then lost); set it to noeviction, where a full store "
                "is an outage the sidecar rides out on local state",
                policy,
                extra={"replica": self.replica, "maxmemory_policy": policy},
            )

    def wall(self) -> float:
        """Now on the store's clock (Unix seconds): what this replica writes and compares there."""
        return self.clock() + self._offset

    async def _sync_clock(self) -> None:
        """Measure the store's clock against this replica's (to within half a round trip)."""
        assert self.client is not None
        t0 = self.clock()
        seconds, micros = await self._timed("ping", self.client.time(), commands=1)
        t1 = self.clock()
        self._offset = seconds + micros / 1e6 - (t0 + t1) / 2
        assert self._loop is not None
        self._next_sync = self._loop.time() + CLOCK_SYNC_SECONDS

    async def _timed(self, op: str, awaitable: Any, *, commands: int, timeout: float | None = None) -> Any:
        """Await one store round trip within the timeout (``timeout_ms`` unless given), counted by
        outcome."""
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                result = await awaitable
        except (RedisError, OSError, TimeoutError):
            self._op_counts.labels(op, "error").inc()
            raise
        self._latency.labels(op).observe(time.perf_counter() - t0)
        self._op_counts.labels(op, "ok").inc()
        self._round_trips.inc()
        self._commands.inc(commands)
        return result

    # -- loads ---------------------------------------------------------------------------------

    async def load(self, identity: Any) -> None:
        if identity.session is None:  # a request chained by a response id (see "response ids")
            return await self._load_response(identity)
        if not self.up:
            return  # the breaker is open: no request waits for the store (the writer probes it)
        assert self._loop is not None
        ids = [identity.session] + [i for i in (identity.parent, identity.root) if i]
        future = self._batch_future
        if future is None:
            future = self._batch_future = self._loop.create_future()
            self._loop.call_soon(self._start_batch)
        self._batch.update(ids)
        self._batch_identities.append(identity)
        await asyncio.shield(future)

    def _start_batch(self) -> None:
        assert self._loop is not None
        ids, identities, future = list(self._batch), self._batch_identities, self._batch_future
        assert future is not None
        self._batch, self._batch_identities, self._batch_future = set(), [], None
        task = self._loop.create_task(self._read_batch(ids, identities, future))
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _read_batch(self, ids: list[str], identities: list[Any], future: asyncio.Future[Any]) -> None:
        """Read the records of ``ids`` and place them; the waiting requests are released however
        this ends (a store failure, a record that does not decode, a defect)."""
        try:
            rows = await self._hashes("load", ids)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("load", exc)
        except Exception:
            log.exception("shared store load failed")
        else:
            records = self._decoded(zip(ids, rows, strict=True))
            for identity in identities:
                try:
                    self._place(identity, records)
                except Exception:  # a record that decodes but does not fit the tree
                    self._unreadable(identity.session, "its place in the tree")
        finally:
            if not future.done():
                future.set_result(None)

    async def _hashes(self, op: str, ids: Sequence[str]) -> list[dict[str, str]]:
        """The stored hashes of these sessions: one pipelined round trip of the request path's."""
        assert self.client is not None
        async with self.client.pipeline(transaction=False) as pipe:
            for sid in ids:
                pipe.hgetall(self.prefix + "s:" + sid)
            return list(await self._timed(op, pipe.execute(), commands=len(ids)))

    def _decoded(self, rows: Any) -> dict[str, Record | None]:
        """Records by id; one that does not decode is left out (its session is served on local
        state here, as during an outage) and logged once."""
        out: dict[str, Record | None] = {}
        for sid, row in rows:
            try:
                out[sid] = decode(sid, row)
            except BadRecord as exc:
                self._unreadable(sid, exc.field)
        return out

    def _unreadable(self, sid: str, what: str) -> None:
        """Log, once per id (a bounded memory of ids), that the store's record of ``sid`` cannot
        be used."""
        if sid in self._bad_logged:
            return
        self._bad_logged[sid] = None
        if len(self._bad_logged) > MAX_LOGGED_BAD:
            self._bad_logged.popitem(last=False)
        self._op_counts.labels("read", "unreadable").inc()
        log.warning(
            "the shared store's record of a session cannot be read (%s): serving the session on local state",
            what,
            extra={"replica": self.replica, "key": self.prefix + "s:" + sid},
        )

    def _place(self, identity: Any, records: dict[str, Record | None]) -> None:
        """Put what the store knows of a request's session (and parent, root hint) into the cache."""
        rec = records.get(identity.session)
        if rec is not None and rec.api:
            self.api.cache(_api_session(rec))
        for other in (identity.parent, identity.root):
            orec = records.get(other) if other else None
            if orec is not None and (orec.live or orec.placeholder):
                self._seed(orec)
        if rec is not None and rec.live:
            self._seed(rec)

    def _seed(self, rec: Record) -> None:
        tree = self.tree
        offset = tree.now() - self.wall()  # store times are the store's clock, the tree's are its own
        tree.seed(
            rec.id,
            rec.above,
            rec.root,
            hinted=rec.above is not None and rec.parent is None,
            deployment=rec.deployment,
            turns=rec.turns,
            final_seen=rec.final_seen,
            created=rec.created + offset,
            last_active=rec.last_active + offset,
            mode_state=rec.mode_state,
            workers=rec.workers,
            worker_turns=rec.worker_turns,
            moves=rec.moves,
            placeholder=rec.placeholder,
            usage=rec.usage,
        )

    # -- the request path: writes behind ---------------------------------------------------------

    def begun(self, turn: Turn) -> None:
        node = turn.node
        sid = node.session
        entry = self._dirty.get(sid)
        if entry is None:
            created = turn.ctx.turn == 1
            held = self.tree.in_flight_of(sid) - 1
            entry = self._dirty[sid] = _Dirty(node, 0 if created else node.turns - 1, held, created)
            if len(self._dirty) > MAX_DIRTY:
                self._drop_oldest()
        elif entry.node is not node:  # a newer session took the id: write it as a new one
            entry.node, entry.created, entry.turns0 = node, True, 0
        if entry.created or entry.in_flight0 == 0:
            self._urgent.add(sid)  # a new session, or this replica starts holding one
            if entry.created and not self._kicked and self.up:
                self._kick()

    def finished(self, turn: Turn) -> None:
        sid = turn.node.session
        if sid not in self._dirty:
            # (the id's newest node: a closed one draining after a take-over is written through it)
            node = self.tree.node_of(sid) or turn.node
            self._dirty[sid] = _Dirty(node, node.turns, self.tree.in_flight_of(sid) + 1, False)

    def _kick(self) -> None:
        """Write soon (after this loop iteration), not at the next tick: a new session is visible
        to the other replicas within a round trip."""
        assert self._loop is not None
        self._kicked = True
        task = self._loop.create_task(self._kicked_flush())
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    async def _kicked_flush(self) -> None:
        self._kicked = False
        try:
            await self._flush(everything=False)
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("flush", exc)
        except Exception:
            log.exception("shared store flush failed")

    def touched(self, turn: Turn, *, mode_state: bool = False) -> None:
        node = turn.node
        entry = self._dirty.get(node.session)
        if entry is None:
            entry = self._dirty[node.session] = _Dirty(node, node.turns, self.tree.in_flight_of(node.session), False)
        if mode_state:
            entry.mode = True
            self._urgent.add(node.session)
        else:
            entry.workers = True

    def used(self, turn: Turn, prompt_tokens: int, cached_tokens: int, reported: bool) -> None:
        node = turn.node
        entry = self._dirty.get(node.session)
        if entry is None:
            entry = self._dirty[node.session] = _Dirty(node, node.turns, self.tree.in_flight_of(node.session), False)
            if len(self._dirty) > MAX_DIRTY:
                self._drop_oldest()
        usage = entry.usage
        if usage is None:
            usage = entry.usage = [0, 0, 0, 0]
        if reported:
            usage[0] += prompt_tokens
            usage[1] += cached_tokens
            usage[2] += 1
        else:
            usage[3] += 1

    def ended(self, ended: Sequence[SessionEnd]) -> None:
        for e in ended:
            if e.reason in _FORGOTTEN:
                continue  # this cache forgot it; the store's sweep ends it fleet-wide
            self._ending[e.session] = str(e.reason)

    def _drop_oldest(self) -> None:
        while len(self._dirty) > MAX_DIRTY:
            sid, _ = self._dirty.popitem(last=False)
            self._urgent.discard(sid)
            self.dropped += 1
            self._dropped.inc()

    # -- flushing ------------------------------------------------------------------------------

    async def _flusher(self) -> None:
        """Every tick: urgent writes, closes and due end checks; every LAZY_SECONDS: everything,
        then the store's sweep (which reads the activity just written)."""
        assert self._loop is not None
        while not self._stopping:
            await asyncio.sleep(self.tick)
            now = self._loop.time()
            lazy = now >= self._next_lazy
            due = [sid for sid, at in self._checks.items() if at <= now]
            if not (lazy or self._urgent or self._ending or due or self._republish or self._acks):
                continue
            if not await self._probe():
                continue
            if lazy:
                self._next_lazy = now + LAZY_SECONDS
            try:
                if now >= self._next_sync:
                    await self._sync_clock()
                await self._flush(everything=lazy, checks=due)
                if lazy:
                    await self._sweep()
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed("flush", exc)
            except Exception:  # a defect must not stop the writer
                log.exception("shared store flush failed")

    async def _flush(self, *, everything: bool, checks: Sequence[str] = (), claims: bool = True) -> None:
        """One round trip: the batched writes (confirmations of ends run here included), then the
        closes and end checks pending here (no end checks without ``claims``: a stopping replica
        claims nothing more).

        What a write carries is taken from the dirty table when the operations are built; what
        changes during the round trip stays pending, and a failed write puts back what it took.
        """
        assert self.client is not None and self._flushing is not None
        async with self._flushing:
            urgent, self._urgent = self._urgent, set()
            # (confirmations stay in _acks until written: a sweep running meanwhile may hand
            # these claims back, and must see them as run here)
            acks = dict(self._acks)
            sids = list(self._dirty) if everything else [s for s in urgent if s in self._dirty]
            ending = dict(self._ending)
            for sid in ending:
                if sid in self._dirty and sid not in urgent:
                    sids.append(sid)
            written: dict[str, _Written] = {}
            # Republished records first: a pending turn count of the same session then adds to
            # the record (an increment to a missing record is dropped).
            republish = self._republish[:REPUBLISH_BATCH]
            del self._republish[:REPUBLISH_BATCH]
            args = self._republish_ops(republish)
            args += self._ops(sids, written, everything=everything)
            for sid, token in acks.items():
                args += ("K", sid, token)
            now_ms = ms(self.wall())
            checked = [*ending, *(c for c in checks if c not in ending)] if claims else []
            calls: list[tuple[Any, list[Any]]] = [
                (
                    self._flush_script,
                    [
                        self.prefix,
                        now_ms,
                        self.replica,
                        self.tomb_ttl,
                        LEASE_SECONDS,
                        int(self.idle_ttl + self.tomb_ttl + KEY_GRACE_SECONDS),
                        *args,
                    ],
                )
            ]
            calls += [
                (self._close_script, [self.prefix, sid, now_ms, reason, self.settle_ms])
                for sid, reason in ending.items()
            ]
            calls += [
                (self._end_script, [self.prefix, sid, now_ms, self.tomb_ttl, self.settle_ms, self.replica])
                for sid in checked
            ]
            try:
                results = await self._scripts("flush", calls)
            except BaseException:
                self._untake(written, urgent)
                self._republish[:0] = republish
                raise
            for sid, w in written.items():
                entry = self._dirty.get(sid)
                if entry is None or entry.node is not w.node:
                    continue
                entry.in_flight0 = w.in_flight
                if w.full:
                    entry.turns0, entry.flags0 = w.turns, w.flags
                node = w.node
                if (
                    node.turns == entry.turns0
                    and self.tree.in_flight_of(sid) == entry.in_flight0
                    and node.flags == entry.flags0
                    and not (entry.created or entry.mode or entry.workers)
                    and entry.usage is None
                ):
                    del self._dirty[sid]
            for sid in ending:
                self._ending.pop(sid, None)
            for sid, token in acks.items():
                if self._acks.get(sid) == token:
                    del self._acks[sid]
            for sid in checked:
                self._checks.pop(sid, None)
            missing, ended, closing, bad, epoch = results[0]
            self._republish.extend(missing)
            for i in range(0, len(ended), 2):
                self._closed_in_store(ended[i], ended[i + 1] or None, ended=True)
            for i in range(0, len(closing), 2):
                self._closed_in_store(closing[i], closing[i + 1], ended=False)
            for sid in bad:
                self._unreadable(sid, "its flags")
            self._saw_epoch(str(epoch))
            for sid, outcome in zip(checked, results[1 + len(ending) :], strict=True):
                self._end_outcome(sid, outcome)

    def _untake(self, written: dict[str, _Written], urgent: set[str]) -> None:
        """A write failed: what it took from the dirty table is pending again. The store may
        have applied it all the same (a reply that came too late): the count of requests in
        flight here goes out again whatever it is then (a holder the store kept from the lost
        write, with the requests finished meanwhile, would hold the session's end forever), at
        the next write."""
        self._urgent |= urgent
        for sid, w in written.items():
            entry = self._dirty.get(sid)
            if entry is not None and entry.node is w.node:
                entry.created |= w.created
                entry.mode |= w.mode
                entry.workers |= w.workers
                if w.usage is not None:
                    pending = entry.usage
                    entry.usage = w.usage if pending is None else [a + b for a, b in zip(pending, w.usage)]
                entry.in_flight0 = -1
                self._urgent.add(sid)

    async def _scripts(
        self,
        op: str,
        calls: Sequence[tuple[Any, list[Any]]],
        *,
        client: aioredis.Redis | None = None,
        timeout: float | None = None,
    ) -> list[Any]:
        """Run these script calls in one pipelined round trip, by hash (on the request path's
        client unless given). A script the store does not have (it restarted, or its scripts
        were flushed) did not run: it is loaded and run again on its own (redis-py's pipelines
        would ask SCRIPT EXISTS on every execute)."""
        client = client or self.client
        assert client is not None
        async with client.pipeline(transaction=False) as pipe:
            for script, args in calls:
                pipe.evalsha(script.sha, 0, *args)
            results = await self._timed(op, pipe.execute(raise_on_error=False), commands=len(calls), timeout=timeout)
        for i, result in enumerate(results):
            if isinstance(result, NoScriptError):
                script, args = calls[i]
                results[i] = await self._timed(op, script(args=args, client=client), commands=2, timeout=timeout)
            elif isinstance(result, Exception):
                raise result
        return list(results)

    def _ops(self, sids: Sequence[str], written: dict[str, _Written], *, everything: bool) -> list[Any]:
        """The flush script's operations for these sessions' changes (nodes read now), recorded in
        ``written`` and taken from the entries. A new session goes out whole; for a known one an
        urgent write carries only what the fleet must see at once (its holders and mode state),
        the lazy one everything (turns, activity, final seen, worker history)."""
        tree_now = self.tree.now()
        wall = self.wall()
        out: list[Any] = []
        for sid in sids:
            entry = self._dirty.get(sid)
            if entry is None:
                continue
            node = entry.node
            full = everything or entry.created
            # This replica's holder of the id: every request of it in flight here, a closed
            # session's still draining after a newer one took the id over included (the store
            # keeps one count per id and replica; the closed one's end waits for its requests).
            held = self.tree.in_flight_of(sid)
            written[sid] = w = _Written(
                node, full, node.turns, held, node.flags, entry.created, entry.mode, full and entry.workers
            )
            entry.created = entry.mode = False
            if full:
                entry.workers = False
            if full:
                active = ms(wall - (tree_now - node.last_active_at))
                deadline = active + int(self._ttl_of(sid) * 1000)
                key_ttl = int(self._ttl_of(sid) + self.tomb_ttl + KEY_GRACE_SECONDS)
            if w.created:
                above = node.parent
                if above is not None and above.flags & _PLACEHOLDER:  # a placeholder made here: tell the others
                    out += ("P", above.session, node.deployment, key_ttl)
                root = self.tree.root_of(sid) or sid
                rec = self._held_api(sid)
                out += (
                    "C",
                    sid,
                    node.deployment,
                    above.session if above is not None else "",
                    "" if root == sid else root,
                    (node.flags & SHARED_FLAGS) | (0 if rec is None else _API),
                    ms(wall - (tree_now - node.created_at)) if rec is None else ms(rec.created_at),
                    active,
                    node.turns,
                    deadline,
                    key_ttl,
                    *_api_fields(rec),
                )
            elif full:
                out += ("U", sid, node.turns - entry.turns0, active, deadline, key_ttl)
                if node.flags & _FINAL_SEEN and not entry.flags0 & _FINAL_SEEN:
                    out += ("F", sid, _FINAL_SEEN)
            if held != entry.in_flight0:
                out += ("H", sid, held)
            if w.mode and node.mode_state is not None:
                out += ("M", sid, node.mode_state)
            if w.workers and node.workers is not None:
                out += ("W", sid, orjson.dumps(node.workers).decode(), node.worker_turns, node.moves)
            if entry.usage is not None:  # increments: with any write of the session (after its C)
                w.usage, entry.usage = entry.usage, None
                out += ("A", sid, *w.usage)
        return out

    def _republish_ops(self, sids: Sequence[str]) -> list[Any]:
        """Records for sessions this replica holds live, written where the store has none (after
        an outage, or a store restart that lost data), with this replica's requests in flight
        (so that no end misses them) and its turn count (a record the store has keeps the higher
        count). A session held in the API table goes out as the API session it is (its fields,
        creation time), so the store lists and counts it again."""
        tree_now = self.tree.now()
        wall = self.wall()
        out: list[Any] = []
        for sid in sids:
            facts = self.tree.facts_of(sid)
            if facts is None:
                continue
            deployment, above, root, flags, turns, created, last_active = facts
            entry = self._dirty.get(sid)
            if entry is not None and entry.node is self.tree.node_of(sid):
                # the count the store had from here: what is pending goes out with the entry's
                # own write, as an increment (counted once, whichever lands first)
                turns = 0 if entry.created else entry.turns0
            active = ms(wall - (tree_now - last_active))
            key_ttl = int(self._ttl_of(sid) + self.tomb_ttl + KEY_GRACE_SECONDS)
            rec = self._held_api(sid)
            out += (
                "R",
                sid,
                deployment,
                above or "",
                "" if root == sid else root,
                flags | (0 if rec is None else _API),
                ms(wall - (tree_now - created)) if rec is None else ms(rec.created_at),
                active,
                turns,
                active + int(self._ttl_of(sid) * 1000),
                key_ttl,
                *_api_fields(rec),
            )
            held = self.tree.in_flight_of(sid)
            if held:
                out += ("H", sid, held)
            node = self.tree.node_of(sid)
            if node is not None and (node.usage_turns or node.unknown_turns):
                usage = [node.prompt_tokens, node.cached_tokens, node.usage_turns, node.unknown_turns]
                if entry is not None and entry.node is node and entry.usage is not None:
                    # what is not written yet follows as increments (counted once, like the turns)
                    usage = [n - pending for n, pending in zip(usage, entry.usage, strict=True)]
                out += ("B", sid, *usage)
        return out

    def _held_api(self, sid: str) -> ApiSession | None:
        """The API session ``sid`` if this replica holds it active (None: traffic, or ended)."""
        rec = self.api.get(sid)
        return rec if rec is not None and rec.status is SessionStatus.ACTIVE else None

    def _ttl_of(self, sid: str) -> float:
        rec = self.api.get(sid)
        if rec is not None:
            return rec.ttl if rec.ttl is not None else 10 * 365 * 86400.0
        return self.idle_ttl

    # -- ends ----------------------------------------------------------------------------------

    def _end_outcome(self, sid: str, outcome: list[Any]) -> None:
        """An end check's answer: claimed (run the end here), wait and check again, or nothing."""
        if outcome[0] == "":
            wait = int(outcome[1])
            if wait >= 0:
                assert self._loop is not None
                self._checks[sid] = self._loop.time() + wait / 1000
            return
        self._claimed(outcome)

    def _claimed(self, row: list[Any]) -> None:
        """The store handed this replica the end of a session (a claim, or a claim handed again
        because its reply may have been lost): tell the cache, run its end actions, and confirm
        the claim once they ran. A claim this replica is running or has run is not run again."""
        sid, token = row[0], row[8]
        if self._running.get(sid) == token or self._acks.get(sid) == token:
            return
        deployment, parent, root, reason = row[1], row[2] or None, row[3], row[5]
        turns = int(row[4]) if str(row[4]).isdigit() else 0  # (a record's count: untrusted)
        why = EndReason(reason) if reason in _REASONS else EndReason.API_CLOSED
        self._closed_in_store(sid, reason, ended=True)
        self._running[sid] = token
        self.ends.run(SessionEnd(sid, parent, root, deployment, why, turns), lambda: self._ran(sid, token))

    def _ran(self, sid: str, token: str) -> None:
        """The end actions of a claimed session ran (or were given up): confirm the claim."""
        if self._running.get(sid) == token:
            del self._running[sid]
        self._acks[sid] = token
        if not self._kicked and self.up and not self._stopping:
            self._kick()

    def _closed_in_store(self, sid: str, reason: str | None, *, ended: bool) -> None:
        """The store says ``sid`` is closing (``ended``: it ended it): this replica admits none
        of its requests from now on. The one local close of a session the fleet closed, on the
        store's clock: its API session is marked closed (expired, for an idle expiry) at the
        store's time; its node closes, and when nothing of it is in flight here its end goes to
        the store to be claimed (a closing session), or nowhere (one the store ended: its end
        ran where it was claimed)."""
        why = EndReason(reason) if reason in _REASONS else EndReason.API_CLOSED
        rec = self.api.get(sid)
        if rec is not None and rec.status is SessionStatus.ACTIVE:
            expired = why is EndReason.IDLE_EXPIRED
            self.api.mark_ended(sid, SessionStatus.EXPIRED if expired else SessionStatus.CLOSED, self.wall())
        drained = self.tree.close(sid, why)
        if ended:
            self._dirty.pop(sid, None)
            self._urgent.discard(sid)
        elif drained:
            self.ended(drained)

    async def close(self, session: str, reason: str) -> int:
        """Start closing ``session`` fleet-wide (the sessions API): 1 closing now, 2 already
        closing, 0 unknown, -1 already ended. A closing session is closed here at once (the
        other replicas by the store's event). Raises StoreUnavailable when the store is
        unavailable (the breaker is left alone: an admin call)."""
        (result,) = await self._admin_scripts(
            "close", [(self._close_script, [self.prefix, session, ms(self.wall()), reason, self.settle_ms])]
        )
        if int(result) > 0:
            self._closed_in_store(session, reason, ended=False)
        return int(result)

    async def create_api(
        self,
        *,
        session: str,
        deployment: str,
        workspace: str | None,
        parent: str | None,
        root: str | None,
        ttl: float | None,
        now: float,
    ) -> Record | int:
        """Create an API session in the store: its record as written, 0 when the id is taken, -2
        at the limit of active API sessions. ``root``: the root of ``parent``'s tree (recorded
        with the session, as the first request of a traffic session records its own). Raises
        StoreUnavailable when the store is unavailable.

        The record is built from what the script wrote, not read back: a read failing after the
        session was created would answer the caller an error for a create that happened (and its
        retry a 409)."""
        deadline = "+inf" if ttl is None else ms(now + ttl)
        key_ttl = int((ttl if ttl is not None else 10 * 365 * 86400.0) + self.tomb_ttl + KEY_GRACE_SECONDS)
        fields = {"d": deployment, "f": str(_API), "c": str(ms(now)), "a": str(ms(now)), "n": "0"}
        for name, value in (
            ("ws", workspace or ""),
            ("p", parent or ""),
            ("r", "" if root is None or root == session else root),
            ("t", "" if ttl is None else repr(ttl)),
        ):
            if value:
                fields[name] = value
        args = [
            self.prefix,
            session,
            deployment,
            fields.get("ws", ""),
            fields.get("p", ""),
            fields.get("t", ""),
            fields["c"],
            deadline,
            key_ttl,
            self.api_cfg.max_sessions,
            fields.get("r", ""),
        ]
        (seq,) = await self._admin_scripts("create", [(self._create_script, args)])
        if int(seq) <= 0:
            return int(seq)
        fields["q"] = str(seq)
        rec = decode(session, fields)
        assert rec is not None
        return rec

    # The calls below serve the admin listener (views, the sessions API). They run on their own
    # connection pool with ADMIN_TIMEOUT_SECONDS and do not depend on the breaker (a slow moment
    # of the request path must not fail the admin's calls, nor the reverse): each asks the store
    # and raises StoreUnavailable when it does not answer in time, leaving the breaker as it is.
    # The request path meets a store that is really down on its own calls.

    def _admin(self) -> aioredis.Redis:
        if self.admin_client is None:
            raise StoreUnavailable("the shared session store is unavailable")
        return self.admin_client

    async def _admin_scripts(self, op: str, calls: Sequence[tuple[Any, list[Any]]]) -> list[Any]:
        client = self._admin()
        try:
            return await self._scripts(op, calls, client=client, timeout=self._admin_timeout)
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable("the shared session store is unavailable") from exc

    async def fetch(
        self, sessions: Sequence[str], *, skip_unreadable: bool = False, fresh: bool = True
    ) -> dict[str, Record | None]:
        """Records of these ids, as the store holds them now (views, the sessions API), read
        ``READ_STEP`` per round trip (decoding a round trip's records is one uninterrupted run on
        the event loop). ``fresh``: this replica's pending writes go out first, so the read sees
        them (a view that reads in many steps asks it of its first read only). A record that does
        not decode raises StoreUnavailable naming it, or with ``skip_unreadable`` is left out (a
        view of many sessions)."""
        if not sessions:
            return {}
        if fresh:
            await self.flush_pending()
        out: dict[str, Record | None] = {}
        for start in range(0, len(sessions), READ_STEP):
            step = sessions[start : start + READ_STEP]
            rows = await self._read(
                "read", lambda pipe, step=step: [pipe.hgetall(self._key(s)) for s in step], len(step)
            )
            for sid, row in zip(step, rows, strict=True):
                try:
                    out[sid] = decode(sid, row)
                except BadRecord as exc:
                    self._unreadable(sid, exc.field)
                    if not skip_unreadable:
                        raise StoreUnavailable(str(exc)) from None
        return out

    def _key(self, session: str) -> str:
        return self.prefix + "s:" + session

    async def child_counts(self, sessions: Sequence[str]) -> list[int]:
        """How many child ids the store records under each of these sessions (ended children
        included): one round trip that costs the same however large a children set grew."""
        if not sessions:
            return []
        rows = await self._read(
            "read", lambda pipe: [pipe.scard(self.prefix + "k:" + s) for s in sessions], len(sessions)
        )
        return [int(n) for n in rows]

    async def child_ids(self, reads: Sequence[tuple[str, int]]) -> list[list[str]]:
        """For each (session, limit): at most ``limit`` (and MAX_CHILDREN_READ) of the child ids
        the store records under it, sorted; one round trip, one scan step per session (no read
        of a whole children set, which may hold millions)."""
        if not reads:
            return []

        def queue(pipe: Any) -> None:
            for sid, limit in reads:
                pipe.sscan(self.prefix + "k:" + sid, 0, count=max(1, min(limit, MAX_CHILDREN_READ)))

        rows = await self._read("read", queue, len(reads))
        # (COUNT is a hint: a scan step may return a few more, or an id twice)
        return [
            sorted(set(row[1]))[: min(limit, MAX_CHILDREN_READ)] for row, (_, limit) in zip(rows, reads, strict=True)
        ]

    async def recent(self, start: int, count: int) -> list[str]:
        """Ids of live sessions by rank, those that stay live the longest (the most recently
        active) first: ``count`` of them from rank ``start``."""
        (rows,) = await self._read(
            "read", lambda pipe: [pipe.zrevrange(self.prefix + "live", start, start + count - 1)], 1
        )
        return list(rows)

    async def roots(self, sessions: Sequence[str]) -> list[str | None]:
        """The root id of each of these sessions; None for one the store no longer holds. One
        round trip of small replies (the root field, and the flags that tell a record exists)."""
        if not sessions:
            return []
        rows = await self._read(
            "read", lambda pipe: [pipe.hmget(self._key(s), "r", "f") for s in sessions], len(sessions)
        )
        return [None if f is None else (r or sid) for sid, (r, f) in zip(sessions, rows, strict=True)]

    async def live_count(self) -> int:
        """Sessions live in the whole fleet."""
        (count,) = await self._read("read", lambda pipe: [pipe.zcard(self.prefix + "live")], 1)
        return int(count)

    async def api_page(self, after: int, count: int) -> list[Record]:
        """Up to ``count`` API sessions created after sequence number ``after``, in creation order
        (records that do not decode are left out)."""
        (ids,) = await self._read(
            "read", lambda pipe: [pipe.zrangebyscore(self.prefix + "api", f"({after}", "+inf", start=0, num=count)], 1
        )
        records = await self.fetch(list(ids), skip_unreadable=True)
        return [r for r in records.values() if r is not None]

    async def _read(self, op: str, queue: Any, commands: int) -> list[Any]:
        """One pipelined read of the admin listener (``queue(pipe)`` adds the commands); raises
        StoreUnavailable."""
        client = self._admin()
        try:
            async with client.pipeline(transaction=False) as pipe:
                queue(pipe)
                return list(await self._timed(op, pipe.execute(), commands=commands, timeout=self._admin_timeout))
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable("the shared session store is unavailable") from exc

    async def flush_pending(self) -> None:
        """Write what this replica has pending (so a view read next sees it). A failure leaves
        the breaker to the writer task, whose next write meets the same store."""
        if self.up and (self._dirty or self._ending):
            with contextlib.suppress(RedisError, OSError, TimeoutError):
                await self._flush(everything=True)

    # -- the sweep and events ------------------------------------------------------------------

    async def _sweep(self) -> None:
        """Claim the idle expiries and cap evictions that are due fleet-wide, and the claims not
        confirmed in time (this replica's, whose reply may have been lost, and dead replicas'),
        in batches. Each batch runs under the writes' lock: a confirmation written while the
        sweep is in flight could otherwise land after the sweep handed its claim back, and the
        end would run twice."""
        assert self._flushing is not None
        while True:
            async with self._flushing:
                claimed, bad = await self._timed(
                    "sweep",
                    self._sweep_script(
                        args=[
                            self.prefix,
                            ms(self.wall()),
                            SWEEP_BATCH,
                            self.cap,
                            self.tomb_ttl,
                            self.settle_ms,
                            int(self.idle_ttl * 1000),
                            self.replica,
                            self.settle_ms,  # a claim's reply is lost or in hand by then
                        ]
                    ),
                    commands=1,
                )
                for row in claimed:
                    self._claimed(row)
                for sid in bad:
                    self._unreadable(sid, "its flags")
            if len(claimed) < SWEEP_BATCH:
                return
            await asyncio.sleep(0)

    async def _listener(self) -> None:
        """Closes and ends published by any replica, applied here within milliseconds. After a
        gap (an outage, a subscription found deaf) every session held here is checked against
        the store."""
        gap = False
        while not self._stopping:
            if not self.up:
                await asyncio.sleep(self.tick)
                gap = True
                continue
            assert self.client is not None
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await self._timed("events", pubsub.subscribe(self.channel), commands=1, timeout=self._admin_timeout)
                if gap:
                    await self._revalidate()
                    gap = False
                await self._receive(pubsub)
                gap = True  # deaf: subscribe again
            except (RedisError, OSError, TimeoutError, StoreUnavailable) as exc:
                gap = True
                if not isinstance(exc, StoreUnavailable):
                    self._failed("events", exc)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()

    async def _receive(self, pubsub: Any) -> None:
        """Apply events until the breaker opens or the subscription proves deaf: silent for
        EVENTS_PING_SECONDS, it is pinged; no answer within EVENTS_DEAF_SECONDS (a connection
        that stays open and delivers nothing: an expired NAT or conntrack entry) ends this."""
        assert self._loop is not None
        heard = self._loop.time()
        pinged: float | None = None
        while self.up and not self._stopping:
            message = await pubsub.get_message(timeout=EVENTS_PING_SECONDS)
            now = self._loop.time()
            if message is not None:
                heard, pinged = now, None
                if message.get("type") == "message":
                    self._on_event(message["data"])
            elif pinged is None:
                if now - heard >= EVENTS_PING_SECONDS:
                    await self._timed("events", pubsub.ping(), commands=1, timeout=self._admin_timeout)
                    pinged = now
            elif now - pinged >= EVENTS_DEAF_SECONDS:
                self._op_counts.labels("events", "deaf").inc()
                log.warning(
                    "the shared store's event subscription did not answer a ping: subscribing again and "
                    "checking the sessions held here",
                    extra={"replica": self.replica},
                )
                return

    def _on_event(self, data: str) -> None:
        self._events += 1
        kind, _, rest = data.partition(" ")
        # "c <id> <reason>", "e <id> <reason>": the reason (an EndReason value) is one word and
        # comes last; the id may hold spaces, so it is everything before the last one.
        sid, _, reason = rest.rpartition(" ")
        if reason not in _REASONS:  # (an end event of an older version: "e <id>")
            sid, reason = rest, ""
        if kind == "c":
            if sid in self._urgent and not self._kicked:
                self._kick()  # a holder of it is not written yet: the end waits for it
            self._closed_in_store(sid, reason or None, ended=False)
        elif kind == "e":
            self._closed_in_store(sid, reason or None, ended=True)

    async def _revalidate(self) -> None:
        """After a gap in the events: ask the store about every session held here (a failure
        opens the breaker: this is the replica's own read)."""
        held = self.tree.held_sessions()
        for i in range(0, len(held), REPUBLISH_BATCH):
            batch = held[i : i + REPUBLISH_BATCH]
            try:
                rows = await self._hashes("read", batch)
            except (RedisError, OSError, TimeoutError) as exc:
                self._failed("read", exc)
                raise StoreUnavailable("the shared session store is unavailable") from exc
            for sid, rec in self._decoded(zip(batch, rows, strict=True)).items():
                if rec is None:
                    self._republish.append(sid)
                elif rec.ended:
                    self._closed_in_store(sid, rec.end_reason, ended=True)
                elif rec.closing:
                    self._closed_in_store(sid, rec.end_reason, ended=False)

    # -- response ids (identity.body: previous_response_id) -------------------------------------
    #
    # Which session produced each response id, shared: one key per id, ``rid:<id>`` holding
    # ``<deployment> <session>`` for ``sessions.response_ids_ttl_seconds``, written behind (each
    # id as it is remembered: one SET, the ids of one loop iteration in one pipelined round
    # trip) and read when a request names an id this replica does not know, before that
    # request's session is loaded as any other (a second read: the session is not known before).

    shares_responses = True
    MAX_PENDING_RESPONSE_IDS = 10_000  # unwritten ids beyond this are dropped (counted)

    def remember_response(self, response_id: str, deployment: str, session: str) -> None:
        super().remember_response(response_id, deployment, session)
        if not self.up:
            return  # the breaker is open: this replica's own map only
        pending = self._response_writes
        if len(pending) >= self.MAX_PENDING_RESPONSE_IDS:
            self.dropped += 1
            self._dropped.inc()
            return
        pending[response_id] = f"{deployment} {session}"
        if len(pending) == 1:  # the first since the last write: written after this loop iteration
            assert self._loop is not None
            task = self._loop.create_task(self._write_responses())
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)

    async def _write_responses(self) -> None:
        assert self.client is not None
        pending = self._response_writes
        batch = dict(pending)
        pending.clear()
        ttl = max(1, math.ceil(self.responses.ttl))
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                for response_id, value in batch.items():
                    pipe.set(self.prefix + "rid:" + response_id, value, ex=ttl)
                await self._timed("response_ids", pipe.execute(), commands=len(batch))
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("response_ids", exc)

    async def _load_response(self, identity: Any) -> None:
        """The session that produced ``identity.response``, from the store (nothing when it
        does not know it, or cannot answer: the request then starts a new session), loaded."""
        if not identity.response or not self.up:
            return
        assert self.client is not None
        try:
            value = await self._timed(
                "response_ids", self.client.get(self.prefix + "rid:" + identity.response), commands=1
            )
        except (RedisError, OSError, TimeoutError) as exc:
            self._failed("response_ids", exc)
            return
        deployment, _, session = (value or "").partition(" ")
        if not session:  # unknown, or a value that does not decode: an unknown id
            return
        self.responses.remember(identity.response, deployment, session)
        await self.load(Identity(session, identity.parent, identity.root, identity.final))

    def stats(self) -> dict[str, Any]:
        return {"up": self.up, "dirty": len(self._dirty), "dropped": self.dropped, "replica": self.replica}


# The flags the writes name, as plain ints (redis-py sends an int's repr: an enum's is not a number).
_PLACEHOLDER, _FINAL_SEEN, _API = int(SessionFlag.PLACEHOLDER), int(SessionFlag.FINAL_SEEN), int(SessionFlag.API)
_FORGOTTEN = frozenset({EndReason.IDLE_EXPIRED, EndReason.EVICTED, EndReason.SHUTDOWN})
_REASONS = frozenset(r.value for r in EndReason)


def _api_fields(rec: ApiSession | None) -> tuple[str, str, str]:
    """What a create op carries of an API session (workspace, TTL, sequence number), so that a
    store that lost the record gets it back as the API session it was; empty for traffic."""
    if rec is None:
        return "", "", ""
    return rec.workspace or "", "" if rec.ttl is None else repr(rec.ttl), str(rec.seq)


def _api_session(rec: Record) -> ApiSession:
    """The sessions API's record of a store record."""
    if rec.ended or rec.closing:
        status = SessionStatus.EXPIRED if rec.end_reason == EndReason.IDLE_EXPIRED else SessionStatus.CLOSED
    else:
        status = SessionStatus.ACTIVE
    return ApiSession(
        rec.id,
        rec.deployment,
        rec.workspace,
        rec.parent,
        rec.ttl,
        rec.created,
        rec.seq,
        status=status,
        last_active_at=rec.last_active or None,
        ended_at=rec.ended_at,
        root=None if rec.root == rec.id else rec.root,
    )


def _hint(exc: BaseException) -> str:
    """Which setting a failure to use the store points at."""
    if isinstance(exc, AuthenticationError):
        return "; check the password: state.password_file, SIDECAR_STATE_PASSWORD or the URL's"
    if isinstance(exc, NoPermissionError):
        return (
            "; the store's user needs EVALSHA, SCRIPT LOAD, PUBLISH, SUBSCRIBE and PING on the keys of state.key_prefix"
        )
    if isinstance(exc, ssl.SSLError) or "SSL" in str(exc):  # (redis-py wraps it in its ConnectionError)
        return "; check state.ca_file and the server's certificate"
    return ""


def _reason(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


__all__ = ["RedisState", "StoreUnavailable"]
