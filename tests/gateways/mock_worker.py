"""A mock OpenAI-compatible inference worker for the gateway tests.

Run: ``python -m tests.gateways.mock_worker --port 18001 --name w1 --model tiny``
(binds 127.0.0.1 only).

Endpoints:
- ``GET /health`` -> 200; ``GET /v1/models`` -> the one model, ``owned_by`` = ``--owned-by``;
- ``POST /v1/chat/completions``: streaming (SSE ``data: {...}`` chunks, then ``data: [DONE]``)
  and non-streaming; the reply text names the worker;
- ``GET /_received`` -> JSON ``{"requests": [{"method", "path", "query", "headers": [[k, v]...]}]}``
  for every request received (except ``/_received`` itself), oldest first, bounded;
  ``DELETE /_received`` clears it.
Every response carries ``X-Mock-Worker: <name>`` so a test can tell which worker served.
Other probes a gateway may send answer 404.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections import deque

from aiohttp import web

WORKER_HEADER = "X-Mock-Worker"
MAX_RECORDED = 10_000

NAME = web.AppKey("name", str)
MODEL = web.AppKey("model", str)
OWNED_BY = web.AppKey("owned_by", str)
CHUNK_DELAY = web.AppKey("chunk_delay", float)
RECEIVED = web.AppKey("received", deque)


@web.middleware
async def record_and_tag(request: web.Request, handler) -> web.StreamResponse:
    """Record the request's headers, then tag whatever answers with the worker's name."""
    if request.path != "/_received":
        request.app[RECEIVED].append(
            {
                "method": request.method,
                "path": request.path,
                "query": request.query_string,
                "headers": [[k, v] for k, v in request.headers.items()],
            }
        )
    try:
        resp = await handler(request)
    except web.HTTPException as exc:
        exc.headers[WORKER_HEADER] = request.app[NAME]
        raise
    if not resp.prepared:
        resp.headers[WORKER_HEADER] = request.app[NAME]
    return resp


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def models(request: web.Request) -> web.Response:
    model = {"id": request.app[MODEL], "object": "model", "created": 0, "owned_by": request.app[OWNED_BY]}
    return web.json_response({"object": "list", "data": [model]})


async def received(request: web.Request) -> web.Response:
    if request.method == "DELETE":
        request.app[RECEIVED].clear()
        return web.json_response({"requests": []})
    return web.json_response({"requests": list(request.app[RECEIVED])})


async def chat_completions(request: web.Request) -> web.StreamResponse:
    try:
        body = await request.json()
    except ValueError:
        return web.json_response({"error": {"message": "body is not JSON"}}, status=400)
    name = request.app[NAME]
    words = f"Hello from {name} .".split()
    base = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.get("model", request.app[MODEL]),
        "system_fingerprint": name,
    }
    usage = {"prompt_tokens": len(json.dumps(body.get("messages", []))) // 4, "completion_tokens": len(words)}
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    if not body.get("stream"):
        message = {"role": "assistant", "content": " ".join(words)}
        return web.json_response(
            {
                **base,
                "object": "chat.completion",
                "usage": usage,
                "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            }
        )
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", WORKER_HEADER: name}
    )
    await resp.prepare(request)
    chunk = {**base, "object": "chat.completion.chunk"}
    for i, word in enumerate(words):
        delta = {"role": "assistant", "content": word} if i == 0 else {"content": " " + word}
        choice = {"index": 0, "delta": delta, "finish_reason": None}
        await resp.write(f"data: {json.dumps({**chunk, 'choices': [choice]})}\n\n".encode())
        await asyncio.sleep(request.app[CHUNK_DELAY])
    last = {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    if (body.get("stream_options") or {}).get("include_usage"):
        last["usage"] = usage
    await resp.write(f"data: {json.dumps(last)}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def make_app(name: str, model: str = "tiny", owned_by: str = "vllm", chunk_delay: float = 0.005) -> web.Application:
    app = web.Application(middlewares=[record_and_tag])
    app[NAME], app[MODEL], app[OWNED_BY], app[CHUNK_DELAY] = name, model, owned_by, chunk_delay
    app[RECEIVED] = deque(maxlen=MAX_RECORDED)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_route("GET", "/_received", received)
    app.router.add_route("DELETE", "/_received", received)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--owned-by", default="vllm", help="runtime reported in /v1/models")
    parser.add_argument("--chunk-delay", type=float, default=0.005, help="seconds between chunks")
    args = parser.parse_args()
    app = make_app(args.name, args.model, args.owned_by, args.chunk_delay)
    web.run_app(app, host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
