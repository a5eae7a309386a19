#!/usr/bin/env bash
# Load benchmark of the gateway, on loopback only, bounded in time.
#
#   bench/load.sh [DURATION_SECONDS=10] [CONNECTIONS=64]
#
# One run, four targets, the same wrk settings: the upstream simulator directly; the gateway
# with no scopes (parse, count, admit an empty plan, forward: "controls off"); the gateway with
# all six controls on the memory store; and with all six on Redis (its own redis-server).
# Prints a Markdown table with req/s, p50, p99 and the ratio to pass-through.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-10}"
CONN="${2:-64}"
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)"; exit 2; }
cargo build --release -q -p tollgate -p tollgate-sim
BIN=target/release
tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 100); do (echo > /dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.05; done; echo "port $1 never opened"; exit 1; }

SIM=$(free_port)
"$BIN/tollgate-sim" --listen "127.0.0.1:$SIM" --latency-ms 0 --token-delay-ms 0 --output-tokens 16 >/dev/null &
pids+=($!)
wait_port "$SIM"
REDIS=$(free_port)
redis-server --port "$REDIS" --bind 127.0.0.1 --save "" --appendonly no --loglevel warning >/dev/null &
pids+=($!)
wait_port "$REDIS"

HASH=$("$BIN/tollgate" hash-key sk-bench)
ALL_SIX='
[[policy.scopes]]
name = "per-key"
key = "key"
requests = { limit = 100000000, window = "1m" }
input_tokens = 100000
output_tokens = { max = 4096, mode = "clamp" }
total_tokens = 200000
concurrency = { limit = 100000, lease_ttl = "1m" }
budget = { tokens = 1000000000000, period = "day" }
'
gateway() { # name store policy
  local port; port=$(free_port)
  cat > "$tmp/$1.toml" <<TOML
$2
[server]
listen = "127.0.0.1:$port"
max_connections = 4096
[[upstreams]]
name = "sim"
base_url = "http://127.0.0.1:$SIM"
models = ["gpt-4o"]
[[keys]]
hash = "$HASH"
tenant = "bench"
$3
TOML
  "$BIN/tollgate" serve --config "$tmp/$1.toml" >/dev/null 2>&1 &
  pids+=($!)
  wait_port "$port"
  echo "$port"
}
PASS=$(gateway pass "" "")
MEM=$(gateway memory "" "$ALL_SIX")
RED=$(gateway redis "[store]
url = \"redis://127.0.0.1:$REDIS/\"
call_timeout = \"2s\"" "$ALL_SIX")

run() { # label port -> "rps p50 p99"
  local out; out=$(wrk -t2 -c"$CONN" -d"${DUR}s" --latency -s bench/post.lua "http://127.0.0.1:$2/v1/chat/completions" 2>&1)
  if echo "$out" | grep -q "Non-2xx"; then echo "$out" >&2; echo "non-2xx responses for $1" >&2; exit 1; fi
  local rps p50 p99
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  echo "$rps $p50 $p99"
}
echo "wrk -t2 -c$CONN -d${DUR}s, one small chat completion (16 output tokens), upstream simulator with no latency; $(nproc) cores shared by wrk, gateway, simulator and Redis; $(date -u +%F)"
echo
echo "| target | req/s | p50 | p99 | vs pass-through |"
echo "|---|---|---|---|---|"
read -r s_rps s50 s99 <<<"$(run direct "$SIM")"
read -r p_rps p50 p99 <<<"$(run pass "$PASS")"
read -r m_rps m50 m99 <<<"$(run memory "$MEM")"
read -r r_rps r50 r99 <<<"$(run redis "$RED")"
ratio() { python3 -c "print(f'{$1/$2:.2f}x')"; }
echo "| simulator direct | $s_rps | $s50 | $s99 | $(ratio "$s_rps" "$p_rps") |"
echo "| gateway, controls off (pass-through) | $p_rps | $p50 | $p99 | 1.00x |"
echo "| gateway, six controls, memory store | $m_rps | $m50 | $m99 | $(ratio "$m_rps" "$p_rps") |"
echo "| gateway, six controls, Redis store | $r_rps | $r50 | $r99 | $(ratio "$r_rps" "$p_rps") |"
