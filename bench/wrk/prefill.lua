-- Prefill: every request opens a new session (a unique X-Correlation-ID), until `total`
-- responses have arrived, so that the proxy's session tree holds `total` live sessions.
--
--   wrk -t1 -s bench/wrk/prefill.lua URL -- [total] [path] [tag]
--     total  sessions to create, default 1000000
--     path   default /v1/chat/completions
--     tag    part of every id, default "fill"; runs with different tags open different sessions
--            (the churn case, j, runs it with a tag per run and a total it never reaches)
--
-- Run with one thread (-t1): ids come from a per-thread counter. The body is a minimal chat
-- request, since only the session count matters here. After `total` responses it prints
-- "prefill-complete" and stops sending; done() prints one {"wrk": JSON line.

local total = 1000000
local path = "/v1/chat/completions"
local tag = "fill"
local body = '{"model":"bench","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}'
local sent = 0
local received = 0

function init(args)
  total = tonumber(args[1]) or total
  path = args[2] or path
  tag = args[3] or tag
end

function request()
  sent = sent + 1
  return wrk.format("POST", path, {
    ["X-Correlation-ID"] = string.format("00000000-%s-4000-8000-%012d", tag, sent),
    ["Content-Type"] = "application/json",
  }, body)
end

function response(status, headers, body)
  received = received + 1
  if received == total then
    -- wrk runs for its full -d even after a thread stops; the harness reads this line and
    -- interrupts wrk (SIGINT), which still prints the summary below.
    io.write("prefill-complete\n")
    io.flush()
    wrk.thread:stop()
  end
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
