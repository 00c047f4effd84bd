"""A scripted LLM endpoint on 127.0.0.1 for the real agent clients (the `agents` suite).

It answers the three APIs the clients speak, streamed as they ask:
``POST /v1/messages`` (Anthropic, Claude Code), ``POST /v1/responses`` (OpenAI Responses, Codex
CLI) and ``POST /v1/chat/completions`` (OpenAI-compatible, opencode), plus ``HEAD /``,
``GET /v1/models`` and ``POST /v1/messages/count_tokens``.

The script: the prompt a test gives the main agent carries the marker ``@@DEPTH0@@``. An agent
whose task carries ``@@DEPTH<n>@@`` with ``n`` below :data:`DEPTH` calls the client's sub-agent
tool with the task ``@@DEPTH<n+1>@@``; the deepest one answers in text; an agent that got its
sub-agent's result back answers in text. So one prompt makes main -> sub-agent -> nested
sub-agent -> answers. The endpoint keeps no state: what to answer follows from the request alone
(the markers in the user's own text, and whether a tool result came back), so it decides nothing
about routing and answers every copy of a request alike. Requests without the sub-agent tool
(titles, summaries) get a short text.

Every request is recorded (method, path, headers as received, body) in :attr:`ScriptedLLM.received`.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web

DEPTH = 2  # main -> sub-agent -> nested sub-agent
MARKER = re.compile(r"@@DEPTH(\d)@@")
_ids = itertools.count(1)


def task(depth: int) -> str:
    """The task text of an agent at ``depth`` (0: the main agent)."""
    return f"@@DEPTH{depth}@@ Reply with one word."


@dataclass
class Request:
    method: str
    path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        low = name.lower()
        return next((v for k, v in self.headers if k.lower() == low), None)

    def json(self) -> Any:
        return orjson.loads(self.body) if self.body else None


@dataclass
class ScriptedLLM:
    received: list[Request] = field(default_factory=list)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> ScriptedLLM:
        app = web.Application(client_max_size=256 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self.handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.url = f"http://{host}:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def posts(self, api: str) -> list[Request]:
        """The POST requests to ``api`` (``/v1/messages``, ``/v1/responses``, ``/v1/chat/completions``)."""
        return [r for r in self.received if r.method == "POST" and r.path.split("?")[0].endswith(api)]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Request(
                request.method,
                request.path_qs,
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers],
                body,
            )
        )
        path = request.path
        if request.method in ("HEAD", "GET"):
            if path.endswith("/models"):
                return web.json_response(
                    {"object": "list", "data": [{"id": "mock-model", "object": "model", "owned_by": "scripted"}]}
                )
            return web.Response(text="ok")
        payload = orjson.loads(body) if body else {}
        if path.endswith("/messages/count_tokens"):
            return web.json_response({"input_tokens": 16})
        if path.endswith("/messages"):
            return await anthropic(request, payload)
        if path.endswith("/responses"):
            return await responses(request, payload)
        if path.endswith("/chat/completions"):
            return await chat(request, payload)
        return web.json_response({"error": {"type": "not_found", "message": path}}, status=404)


# -- what to answer --------------------------------------------------------------------------


def depth_of(texts: list[str]) -> int | None:
    """The depth an agent works at: the deepest marker in its user's own texts."""
    found = [int(m) for t in texts for m in MARKER.findall(t)]
    return max(found) if found else None


def plan(texts: list[str], has_tool: bool, tool_came_back: bool) -> int | None:
    """The depth of the sub-agent to spawn now, or None to answer in text."""
    depth = depth_of(texts)
    if depth is None or tool_came_back or not has_tool or depth >= DEPTH:
        return None
    return depth + 1


def answer_text(texts: list[str]) -> str:
    depth = depth_of(texts)
    return "done" if depth is None else f"done at depth {depth}"


# -- Anthropic Messages (Claude Code) -------------------------------------------------------


def _user_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The texts of the user's messages (string contents and text blocks: tool results excluded)."""
    texts: list[str] = []
    for message in messages:
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            texts.append(content)
        else:
            texts += [str(b.get("text", "")) for b in content or [] if isinstance(b, dict) and b.get("type") == "text"]
    return texts


def anthropic_texts(payload: dict[str, Any]) -> tuple[list[str], bool]:
    """The user's texts, and whether a tool result came back (each agent of the script calls
    one tool: it then answers)."""
    messages = payload.get("messages") or []
    came_back = any(
        isinstance(b, dict) and b.get("type") == "tool_result"
        for m in messages
        if m.get("role") == "user" and isinstance(m.get("content"), list)
        for b in m["content"]
    )
    return _user_texts(messages), came_back


async def anthropic(request: web.Request, payload: dict[str, Any]) -> web.StreamResponse:
    texts, came_back = anthropic_texts(payload)
    tools = {t.get("name") for t in payload.get("tools") or []}
    spawn = plan(texts, "Agent" in tools, came_back)
    msg_id = f"msg_{next(_ids)}"
    model = payload.get("model", "mock-model")
    if spawn is not None:
        block: dict[str, Any] = {"type": "tool_use", "id": f"toolu_{next(_ids)}", "name": "Agent", "input": {}}
        args = {"description": f"depth {spawn} task", "prompt": task(spawn), "subagent_type": "general-purpose"}
        delta = {"type": "input_json_delta", "partial_json": orjson.dumps(args).decode()}
        stop = "tool_use"
        content = [{**block, "input": args}]
    else:
        text = answer_text(texts)
        block = {"type": "text", "text": ""}
        delta = {"type": "text_delta", "text": text}
        stop = "end_turn"
        content = [{"type": "text", "text": text}]
    usage = {"input_tokens": 16, "output_tokens": 4, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}
    if not payload.get("stream"):
        return web.json_response(
            {
                "id": msg_id,
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": content,
                "stop_reason": stop,
                "stop_sequence": None,
                "usage": usage,
            }
        )
    resp = await _sse(request)
    start = {"id": msg_id, "type": "message", "role": "assistant", "model": model, "content": []}
    await _event(resp, "message_start", {"type": "message_start", "message": {**start, "usage": usage}})
    await _event(resp, "content_block_start", {"type": "content_block_start", "index": 0, "content_block": block})
    await _event(resp, "content_block_delta", {"type": "content_block_delta", "index": 0, "delta": delta})
    await _event(resp, "content_block_stop", {"type": "content_block_stop", "index": 0})
    await _event(
        resp,
        "message_delta",
        {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None}, "usage": {"output_tokens": 4}},
    )
    await _event(resp, "message_stop", {"type": "message_stop"})
    await resp.write_eof()
    return resp


# -- OpenAI Responses (Codex CLI) -------------------------------------------------------------

SPAWN_NAMESPACE = "multi_agent_v1"


def responses_input(payload: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The user's own texts, and the function calls and outputs of the input (in order)."""
    items = payload.get("input")
    if isinstance(items, str):
        return [items], []
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    for item in items or []:
        kind = item.get("type")
        if kind == "message" and item.get("role") == "user":
            content = item.get("content")
            if isinstance(content, str):
                texts.append(content)
            else:
                texts += [str(c.get("text", "")) for c in content or [] if c.get("type") == "input_text"]
        elif kind in ("function_call", "function_call_output"):
            calls.append(item)
    return texts, calls


def _has_spawn(payload: dict[str, Any]) -> bool:
    for tool in payload.get("tools") or []:
        if tool.get("type") == "namespace" and tool.get("name") == SPAWN_NAMESPACE:
            return any(t.get("name") == "spawn_agent" for t in tool.get("tools") or [])
    return False


def _agent_id(output: Any) -> str | None:
    """The agent id in a spawn_agent output (a JSON object, maybe as a string)."""
    if isinstance(output, str):
        try:
            output = orjson.loads(output)
        except orjson.JSONDecodeError:
            found = re.search(r'"(?:agent_id|id)"\s*:\s*"([^"]+)"', output)
            return found.group(1) if found else None
    if isinstance(output, dict):
        for key in ("agent_id", "id"):
            if isinstance(output.get(key), str):
                return output[key]
    return None


def responses_step(payload: dict[str, Any]) -> tuple[str, dict[str, Any] | str]:
    """What a Codex agent does next: ("call", a function call item) or ("text", the answer).

    spawn_agent(task) -> wait_agent([its id]) -> answer; the deepest agent answers at once."""
    texts, calls = responses_input(payload)
    names = {c.get("call_id"): c.get("name") for c in calls if c.get("type") == "function_call"}
    outputs = [c for c in calls if c.get("type") == "function_call_output"]
    last = outputs[-1] if outputs and calls[-1] is outputs[-1] else None
    if last is not None and names.get(last.get("call_id")) == "spawn_agent":
        agent = _agent_id(last.get("output"))
        if agent is not None:
            return "call", _function_call("wait_agent", {"targets": [agent], "timeout_ms": 60000})
    if last is not None and names.get(last.get("call_id")) == "wait_agent":
        return "text", answer_text(texts)
    spawn = plan(texts, _has_spawn(payload), bool(outputs))
    if spawn is not None:
        return "call", _function_call("spawn_agent", {"message": task(spawn)})
    return "text", answer_text(texts)


def _function_call(name: str, args: dict[str, Any]) -> dict[str, Any]:
    n = next(_ids)
    return {
        "type": "function_call",
        "id": f"fc_{n}",
        "call_id": f"call_{n}",
        "namespace": SPAWN_NAMESPACE,
        "name": name,
        "arguments": orjson.dumps(args).decode(),
        "status": "completed",
    }


async def responses(request: web.Request, payload: dict[str, Any]) -> web.StreamResponse:
    kind, what = responses_step(payload)
    if kind == "call":
        assert isinstance(what, dict)
        item = what
    else:
        item = {
            "type": "message",
            "id": f"msg_{next(_ids)}",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": what, "annotations": []}],
        }
    rid = f"resp_{next(_ids)}"
    usage = {
        "input_tokens": 16,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 20,
    }
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": payload.get("model")}
    done = {**base, "status": "completed", "output": [item], "usage": usage}
    if not payload.get("stream"):
        return web.json_response(done)
    resp = await _sse(request)
    seq = itertools.count()
    created = {**base, "status": "in_progress", "output": []}
    await _event(
        resp, "response.created", {"type": "response.created", "sequence_number": next(seq), "response": created}
    )
    await _event(
        resp,
        "response.output_item.added",
        {"type": "response.output_item.added", "sequence_number": next(seq), "output_index": 0, "item": item},
    )
    await _event(
        resp,
        "response.output_item.done",
        {"type": "response.output_item.done", "sequence_number": next(seq), "output_index": 0, "item": item},
    )
    await _event(
        resp, "response.completed", {"type": "response.completed", "sequence_number": next(seq), "response": done}
    )
    await resp.write_eof()
    return resp


# -- OpenAI chat completions (opencode) -----------------------------------------------------


def chat_texts(payload: dict[str, Any]) -> tuple[list[str], bool]:
    messages = payload.get("messages") or []
    return _user_texts(messages), any(m.get("role") == "tool" for m in messages)


async def chat(request: web.Request, payload: dict[str, Any]) -> web.StreamResponse:
    texts, came_back = chat_texts(payload)
    tools = {(t.get("function") or {}).get("name") for t in payload.get("tools") or []}
    spawn = plan(texts, "task" in tools, came_back)
    cid = f"chatcmpl-{next(_ids)}"
    model = payload.get("model", "mock-model")
    if spawn is not None:
        args = {"description": f"depth {spawn} task", "prompt": task(spawn), "subagent_type": "general"}
        call = {"id": f"call_{next(_ids)}", "type": "function", "function": {"name": "task", "arguments": ""}}
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [call]}
        finish = "tool_calls"
        deltas = [
            {"role": "assistant", "tool_calls": [{"index": 0, **call}]},
            {"tool_calls": [{"index": 0, "function": {"arguments": orjson.dumps(args).decode()}}]},
        ]
        message["tool_calls"] = [{**call, "function": {"name": "task", "arguments": orjson.dumps(args).decode()}}]
    else:
        text = answer_text(texts) if payload.get("tools") else "A title"
        message = {"role": "assistant", "content": text}
        finish = "stop"
        deltas = [{"role": "assistant", "content": ""}, {"content": text}]
    usage = {"prompt_tokens": 16, "completion_tokens": 4, "total_tokens": 20}
    base = {"id": cid, "created": int(time.time()), "model": model}
    if not payload.get("stream"):
        choice = {"index": 0, "message": message, "finish_reason": finish}
        return web.json_response({**base, "object": "chat.completion", "choices": [choice], "usage": usage})
    resp = await _sse(request)
    for delta in deltas:
        chunk = {
            **base,
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": delta, "finish_reason": None}],
        }
        await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
    last = {**base, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
    await resp.write(b"data: " + orjson.dumps(last) + b"\n\n")
    tail = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
    await resp.write(b"data: " + orjson.dumps(tail) + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def depth_of_request(request: Request) -> int | None:
    """The depth of the agent that sent ``request`` (0: the main agent), by its task's marker."""
    payload = request.json() or {}
    path = request.path.split("?")[0]
    if path.endswith("/messages"):
        texts, _ = anthropic_texts(payload)
    elif path.endswith("/responses"):
        texts, _ = responses_input(payload)
    else:
        texts, _ = chat_texts(payload)
    return depth_of(texts)


# -- SSE ------------------------------------------------------------------------------------


async def _sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def _event(resp: web.StreamResponse, name: str, data: dict[str, Any]) -> None:
    await resp.write(b"event: " + name.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n")


async def _main(port: int) -> None:  # pragma: no cover - a manual run: python -m tests.agents.scripted_llm PORT
    llm = await ScriptedLLM().start(port=port)
    print(f"scripted LLM on {llm.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await llm.stop()


if __name__ == "__main__":  # pragma: no cover
    import sys

    asyncio.run(_main(int(sys.argv[1])))
