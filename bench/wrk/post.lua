-- Header-mode load: each request carries X-Correlation-ID, cycling over a fixed set of ids.
--
--   wrk -s bench/wrk/post.lua URL -- [ids] [method] [path] [body_bytes]
--     ids         distinct X-Correlation-ID values (sessions), default 1000
--     method      POST (a JSON chat-completions body) or GET (no body), default POST
--     path        default /v1/chat/completions
--     body_bytes  size of the POST body, default 1024
--
-- Every request is formatted once in init(); request() only picks the next one, so the load
-- generator spends its time on sockets, not in Lua. done() prints one JSON line starting with
-- {"wrk": that bench/proxy_bench.py parses.

local reqs = {}
local count = 0
local i = 0

-- A chat-completions request padded to exactly `size` bytes with filler in the user message.
local function chat_body(size)
  local head = '{"model":"bench","max_tokens":16,"stream":false,"messages":[{"role":"user","content":"'
  local tail = '"}]}'
  local pad = size - #head - #tail
  if pad < 0 then pad = 0 end
  return head .. string.rep("x", pad) .. tail
end

function init(args)
  count = tonumber(args[1]) or 1000
  local method = args[2] or "POST"
  local path = args[3] or "/v1/chat/completions"
  local body = nil
  if method == "POST" then
    body = chat_body(tonumber(args[4]) or 1024)
  end
  for k = 1, count do
    local headers = {["X-Correlation-ID"] = string.format("00000000-bench-4000-8000-%012d", k)}
    if body then headers["Content-Type"] = "application/json" end
    reqs[k] = wrk.format(method, path, headers, body)
  end
end

function request()
  i = i + 1
  if i > count then i = 1 end
  return reqs[i]
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"wrk": 1, "requests": %d, "duration_us": %d, "bytes": %d, ' ..
    '"p50_us": %d, "p90_us": %d, "p99_us": %d, "max_us": %d, ' ..
    '"errors": {"connect": %d, "read": %d, "write": %d, "status": %d, "timeout": %d}}\n',
    summary.requests, summary.duration, summary.bytes,
    latency:percentile(50), latency:percentile(90), latency:percentile(99), latency.max,
    e.connect, e.read, e.write, e.status, e.timeout))
end
