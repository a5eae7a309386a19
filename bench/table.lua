-- wrk: one workload of bench/table.sh, chosen by TABLE_WORKLOAD. Each thread sends to its own
-- address of TABLE_ADDRS ("host:port,host:port", taken in turn), and the run ends with one JSON
-- line: requests, seconds, errors, p50 and p99 (µs).
local workload = os.getenv("TABLE_WORKLOAD") or "chat"
local keys = tonumber(os.getenv("TABLE_KEYS") or "1000")
-- A gateway that knows one key only (LiteLLM without its database) gets that one throughout.
local only_key = os.getenv("TABLE_ONLY_KEY")

local function words(tokens)
  -- "lorem " is one token in o200k and cl100k: a prompt of about `tokens` tokens.
  return string.rep("lorem ", tokens)
end

local function chat(content, extra)
  return '{"model":"gpt-4o","max_tokens":16' .. (extra or "") ..
    ',"messages":[{"role":"user","content":"' .. content .. '"}]}'
end

local bodies = {
  chat = chat("Say hello in three words."),
  stream = chat("Say hello in three words.", ',"stream":true,"stream_options":{"include_usage":true}'),
  tools = '{"model":"gpt-4o","max_tokens":16,' ..
    '"tools":[{"type":"function","function":{"name":"lookup","description":"Looks up an order.",' ..
    '"parameters":{"type":"object","properties":{"id":{"type":"string"}},"required":["id"]}}}],' ..
    '"messages":[{"role":"system","content":"You help with orders."},' ..
    '{"role":"user","content":"Where is order 42?"},' ..
    '{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function",' ..
    '"function":{"name":"lookup","arguments":"{\\"id\\":\\"42\\"}"}}]},' ..
    '{"role":"tool","tool_call_id":"call_1","content":"Shipped on Monday."}]}',
  prompt1k = chat(words(1000)),
  prompt10k = chat(words(10000)),
  prompt100k = chat(words(100000)),
  keys = chat("Say hello in three words."),
}

local threads = {}
local next_addr = 0

function setup(thread)
  local list = {}
  for a in string.gmatch(os.getenv("TABLE_ADDRS") or "127.0.0.1:8080", "[^,]+") do
    list[#list + 1] = a
  end
  local host, port = string.match(list[(next_addr % #list) + 1], "([^:]+):(%d+)")
  next_addr = next_addr + 1
  thread.addr = wrk.lookup(host, port)[1]
  thread:set("id", next_addr)
  table.insert(threads, thread)
end

local n = 0

function init(args)
  wrk.method = "POST"
  wrk.headers["content-type"] = "application/json"
  wrk.body = bodies[workload]
end

function request()
  n = n + 1
  local key = "sk-bench"
  if workload == "keys" then
    -- A flood over many keys: each one its own per-key scope.
    key = "sk-bench-" .. (n % keys)
  end
  wrk.headers["authorization"] = "Bearer " .. (only_key or key)
  return wrk.format()
end

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{"requests":%d,"seconds":%.3f,"errors":%d,"status_errors":%d,"p50_us":%d,"p99_us":%d}\n',
    summary.requests, summary.duration / 1e6, e.connect + e.read + e.write + e.timeout,
    e.status, latency:percentile(50), latency:percentile(99)))
end
