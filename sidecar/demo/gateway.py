"""The mock inference gateway behind ``sidecar demo``: N workers, Dynamo-style session affinity.

Contract (what a client of the app can rely on):

* ``POST /v1/chat/completions`` takes an OpenAI chat-completions body (``messages``: a list of
  ``{"role": str, "content": str}``; ``stream``; ``stream_options.include_usage``) and answers
  OpenAI-compatibly: streaming as SSE ``data: {...}`` chunks a few milliseconds apart, then
  ``data: [DONE]``; otherwise one JSON object. ``usage`` carries ``prompt_tokens``,
  ``completion_tokens``, ``total_tokens`` and ``prompt_tokens_details.cached_tokens`` (always in
  the non-streaming answer; in a final chunk with empty ``choices`` when ``include_usage`` is set).
  Every answer carries ``X-Worker-Id: w<k>``, the worker that served it. Bad bodies get 400 with
  an OpenAI-style JSON error.
* Routing, as Dynamo's frontend does with session affinity: a request carrying
  ``X-Dynamo-Session-ID`` (trimmed; empty means absent; longer than 256 bytes is a 400) is pinned
  to the worker chosen for that session's first request. Any other request is placed on its own,
  on the least-loaded worker (fewest requests in flight), ties broken round-robin: nothing keeps
  a conversation's turns together, so under concurrent sessions they move between workers.
* Prefix cache, per worker: the rendered prompt is split into word tokens; full 16-token blocks
  are identified by chained hashes (each block's hash covers every token before it, as KV block
  hashing does) and kept in a bounded LRU. A request's ``cached_tokens`` is the length of the
  longest run of leading blocks the worker already holds, never the whole prompt (the last token
  is always computed). After answering, the worker holds the blocks of prompt + reply, so the
  next turn of the conversation, whose prompt extends this one, hits them on the same worker.
* ``GET /health`` answers 200, ``GET /v1/models`` lists the model.

All state is bounded: pinned sessions (LRU), cache blocks per worker (LRU), the routing log.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import hdrs, web

from sidecar.headers import CONTENT_TYPE, X_DYNAMO_SESSION_ID, X_REQUEST_ID

# Demo-only response header naming the worker that served a request.
X_WORKER_ID = "X-Worker-Id"

MODEL_NAME = "demo-model"
BLOCK_SIZE = 16
# Dynamo rejects longer X-Dynamo-Session-ID values with 400 "Invalid request".
MAX_SESSION_ID_BYTES = 256

_WORDS: tuple[str, ...] = (
    "cache",
    "token",
    "prefix",
    "worker",
    "session",
    "stream",
    "batch",
    "model",
    "prompt",
    "router",
    "latency",
    "kernel",
    "tensor",
    "decode",
    "prefill",
    "block",
    "layer",
    "turn",
    "agent",
    "tool",
    "context",
    "answer",
    "query",
    "vector",
    "memory",
    "graph",
    "plan",
    "step",
    "result",
    "signal",
    "request",
    "reply",
    "budget",
    "window",
    "shard",
    "replica",
    "queue",
    "schedule",
    "throughput",
    "warm",
    "cold",
    "hit",
    "miss",
    "evict",
    "page",
    "attention",
)


def render_chat(messages: Sequence[dict[str, str]]) -> list[str]:
    """Word tokens of a chat prompt: ``<|role|>`` then the content's words, per message, then
    the ``<|assistant|>`` generation prompt. A conversation's next prompt (this prompt + the
    reply + a new user message) therefore extends this one token for token."""
    tokens: list[str] = []
    for message in messages:
        tokens.append(f"<|{message['role']}|>")
        tokens.extend(message["content"].split())
    tokens.append("<|assistant|>")
    return tokens


def reply_words(prompt_tokens: Sequence[str], *, lo: int = 12, hi: int = 24) -> list[str]:
    """The mock model's reply: a deterministic function of the prompt, ``lo``..``hi`` words."""
    digest = hashlib.blake2b("\x1f".join(prompt_tokens).encode(), digest_size=8).digest()
    rng = random.Random(int.from_bytes(digest, "big"))
    return [rng.choice(_WORDS) for _ in range(rng.randint(lo, hi))]


class PrefixCache:
    """One worker's KV prefix cache: chained hashes of full ``block_size``-token blocks, LRU-bounded
    to ``capacity_blocks``. Losing a block (eviction) ends every match at that block."""

    def __init__(self, *, block_size: int = BLOCK_SIZE, capacity_blocks: int = 8192) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError("block_size and capacity_blocks must be >= 1")
        self.block_size = block_size
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def _hashes(self, tokens: Sequence[str], n_blocks: int) -> Iterable[bytes]:
        parent = b""
        bs = self.block_size
        for i in range(n_blocks):
            h = hashlib.blake2b(parent, digest_size=16)
            h.update("\x1f".join(tokens[i * bs : (i + 1) * bs]).encode())
            parent = h.digest()
            yield parent

    def match(self, tokens: Sequence[str]) -> int:
        """Cached tokens for a prompt: leading blocks held, counting only blocks that end before
        the prompt's last token (which is always computed). Refreshes the hit blocks' recency."""
        hits = 0
        for digest in self._hashes(tokens, max(len(tokens) - 1, 0) // self.block_size):
            if digest not in self._blocks:
                break
            self._blocks.move_to_end(digest)
            hits += 1
        return hits * self.block_size

    def insert(self, tokens: Sequence[str]) -> None:
        """Hold every full block of ``tokens`` (as after prefill + decode), evicting the least
        recently used blocks beyond capacity."""
        for digest in self._hashes(tokens, len(tokens) // self.block_size):
            self._blocks[digest] = None
            self._blocks.move_to_end(digest)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


@dataclass
class Worker:
    """One mock inference worker: its name, requests in flight, and prefix cache."""

    name: str
    cache: PrefixCache
    in_flight: int = 0


@dataclass(frozen=True, slots=True)
class RoutedRequest:
    """What the gateway saw and decided for one request (the demo's ground truth)."""

    worker: str
    session: str | None
    request_id: str | None
    prompt_tokens: int
    cached_tokens: int


class BadRequest(ValueError):
    """A request the gateway refuses with 400."""


@dataclass
class MockGateway:
    """Workers, session pins and routing state of the mock gateway. Single event loop, no locks:
    :meth:`route` and :meth:`release` are synchronous and never await.

    ``chunk_delay_s`` is the pause between streamed chunks; ``words_per_chunk`` how many reply
    words each content chunk carries.
    """

    n_workers: int = 4
    chunk_delay_s: float = 0.002
    words_per_chunk: int = 3
    max_sessions: int = 65_536
    capacity_blocks: int = 8192
    log_size: int = 10_000
    workers: list[Worker] = field(init=False)
    log: deque[RoutedRequest] = field(init=False)
    _pins: OrderedDict[str, int] = field(init=False)
    _rr: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.n_workers < 1:
            raise ValueError("n_workers must be >= 1")
        self.workers = [
            Worker(f"w{k}", PrefixCache(capacity_blocks=self.capacity_blocks)) for k in range(self.n_workers)
        ]
        self.log = deque(maxlen=self.log_size)
        self._pins = OrderedDict()

    def reset(self) -> None:
        """Forget pins, caches and the log (a cold cluster). Requests still in flight stay
        counted until they are released."""
        for w in self.workers:
            w.cache.clear()
        self._pins.clear()
        self.log.clear()
        self._rr = 0

    def pinned_worker(self, session: str) -> str | None:
        """The worker a session is pinned to, if any."""
        k = self._pins.get(session)
        return None if k is None else self.workers[k].name

    def _least_loaded(self) -> int:
        n = len(self.workers)
        best = min(w.in_flight for w in self.workers)
        for i in range(n):
            k = (self._rr + i) % n
            if self.workers[k].in_flight == best:
                self._rr = (k + 1) % n
                return k
        raise AssertionError("unreachable")

    def _pick(self, session: str | None) -> int:
        if session is not None:
            k = self._pins.get(session)
            if k is not None:
                self._pins.move_to_end(session)
                return k
            k = self._least_loaded()
            self._pins[session] = k
            if len(self._pins) > self.max_sessions:
                self._pins.popitem(last=False)
            return k
        return self._least_loaded()

    def route(self, session_header: str | None, request_id: str | None, tokens: Sequence[str]) -> tuple[Worker, int]:
        """Choose the worker for a request and count it in flight; returns it with the number
        of cached prompt tokens. ``request_id`` is only recorded in :attr:`log`. Raises
        :class:`BadRequest` for an oversized session id. Every call must be paired with
        :meth:`release`."""
        session = (session_header or "").strip() or None
        if session is not None and len(session.encode()) > MAX_SESSION_ID_BYTES:
            raise BadRequest(f"{X_DYNAMO_SESSION_ID} longer than {MAX_SESSION_ID_BYTES} bytes")
        worker = self.workers[self._pick(session)]
        worker.in_flight += 1
        cached = worker.cache.match(tokens)
        self.log.append(RoutedRequest(worker.name, session, request_id, len(tokens), cached))
        return worker, cached

    def release(self, worker: Worker, tokens: Sequence[str] | None) -> None:
        """End a request on ``worker``; ``tokens`` (prompt + reply) become cached when the
        request completed, ``None`` when it was abandoned."""
        worker.in_flight -= 1
        if tokens is not None:
            worker.cache.insert(tokens)


GATEWAY_KEY = web.AppKey("gateway", MockGateway)


def _error(status: int, message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


def _parse_messages(body: Any) -> list[dict[str, str]]:
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise BadRequest("each message needs string role and content")
    return messages


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    gw = request.app[GATEWAY_KEY]
    try:
        body = orjson.loads(await request.read())
        messages = _parse_messages(body)
        tokens = render_chat(messages)
        worker, cached = gw.route(request.headers.get(X_DYNAMO_SESSION_ID), request.headers.get(X_REQUEST_ID), tokens)
    except orjson.JSONDecodeError:
        return _error(400, "body is not valid JSON")
    except BadRequest as exc:
        return _error(400, str(exc))

    completed: list[str] | None = None
    try:
        reply = reply_words(tokens)
        usage = {
            "prompt_tokens": len(tokens),
            "completion_tokens": len(reply),
            "total_tokens": len(tokens) + len(reply),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        model = body.get("model") or MODEL_NAME
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if not body.get("stream"):
            completed = tokens + reply
            answer = {
                "id": rid,
                "object": "chat.completion",
                "model": model,
                "choices": [
                    {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": " ".join(reply)}}
                ],
                "usage": usage,
            }
            return web.Response(
                body=orjson.dumps(answer), content_type="application/json", headers={X_WORKER_ID: worker.name}
            )

        resp = web.StreamResponse(
            headers={CONTENT_TYPE: "text/event-stream", hdrs.CACHE_CONTROL: "no-cache", X_WORKER_ID: worker.name}
        )
        await resp.prepare(request)
        base = {"id": rid, "object": "chat.completion.chunk", "model": model}
        await resp.write(
            _sse(
                {
                    **base,
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                }
            )
        )
        step = gw.words_per_chunk
        for i in range(0, len(reply), step):
            await asyncio.sleep(gw.chunk_delay_s)
            text = " ".join(reply[i : i + step]) + (" " if i + step < len(reply) else "")
            await resp.write(
                _sse({**base, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]})
            )
        await resp.write(_sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
        stream_options = body.get("stream_options")
        if isinstance(stream_options, dict) and stream_options.get("include_usage"):
            await resp.write(_sse({**base, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        completed = tokens + reply
        return resp
    finally:
        gw.release(worker, completed)


async def _models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list", "data": [{"id": MODEL_NAME, "object": "model", "owned_by": "sidecar-demo"}]}
    )


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


def create_gateway_app(gateway: MockGateway | None = None) -> web.Application:
    """The mock gateway's aiohttp application; its state is ``app[GATEWAY_KEY]``."""
    app = web.Application()
    app[GATEWAY_KEY] = gateway if gateway is not None else MockGateway()
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app
