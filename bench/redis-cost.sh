#!/usr/bin/env bash
# Instructions Redis spends per request of the gateway's Redis setup (six controls, one call per
# admission: its admission and its ending), counted by Valgrind (callgrind) on the redis-server
# process while the gateway runs at full speed: the scripts' cost in a unit that a shared
# machine's load does not move (bench/load.sh reads Redis's CPU time per request instead).
#
#   bench/redis-cost.sh [DURATION_SECONDS=8] [CONNECTIONS="1 16"]
#   TOLLGATE_BENCH_AGAINST=DIR bench/redis-cost.sh ...  (counts the `tollgate` binary in DIR as
#   well, an earlier build: see load.sh)
#
# With one connection every call carries one item, so a call's own cost (its arguments, its
# script's set-up, the sweep, the store's clock) falls on each request. With more, callers that
# wait at the same moment share a call; Redis under Valgrind runs many times slower, so its
# calls carry more items than at full speed, and the count moves with how many (a few per cent
# from run to run).
#
# Needs valgrind, wrk and redis-server (valgrind is installed here when missing and run as root).
# Everything listens on free loopback ports and is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-8}"
CONNS="${2:-1 16}"
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)"; exit 2; }
. bench/need-valgrind.sh
. bench/gateways.sh

SIM=$(free_port)
"$BIN/tollgate-sim" --listen "127.0.0.1:$SIM" --latency-ms 0 --token-delay-ms 0 --output-tokens 16 >/dev/null &
pids+=($!)
wait_port "$SIM"

count() { # name bin-dir connections -> "requests instructions-per-request"
  local port; port=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$tmp/$1.cg.%p" redis-server --port "$port" \
    --bind 127.0.0.1 --save "" --appendonly no --loglevel warning >/dev/null 2>"$tmp/$1.valgrind.log" &
  local vg=$!
  pids+=($vg)
  wait_port "$port" 600
  local store; store=$(redis_store_toml "$port")
  printf '%s\n' "$store" > "$tmp/probe.toml"
  # An earlier build without the setting has slices off unless [store.slices] is given.
  "$2/tollgate" check --config "$tmp/probe.toml" >/dev/null 2>&1 \
    || store=$(printf '[store]\nurl = "redis://127.0.0.1:%s/"\ncall_timeout = "5s"\n' "$port")
  local gw; gw=$(BIN="$2" gateway "$1" "$store" "$ALL_SIX")
  local url="http://127.0.0.1:$gw/v1/chat/completions"
  wrk -t1 -c"$3" -d5s -s bench/post.lua "$url" >/dev/null
  callgrind_control -z "$vg" >/dev/null 2>&1
  local out; out=$(wrk -t1 -c"$3" -d"${DUR}s" -s bench/post.lua "$url")
  callgrind_control -d "$vg" >/dev/null 2>&1
  kill "$(cat "$tmp/pid-$1")" "$vg"; wait "$vg" 2>/dev/null || true
  if echo "$out" | grep -q "Non-2xx"; then echo "$out" >&2; echo "non-2xx responses for $1" >&2; exit 1; fi
  local n; n=$(echo "$out" | awk '/requests in/ {print $1}')
  local total; total=$(callgrind_annotate "$tmp/$1.cg.$vg.1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  echo "$n $((total / n))"
}

echo "Redis instructions per request (callgrind on redis-server), six controls, one call per admission;"
echo "wrk -t1 for ${DUR}s after a 5 s warm-up; $(date -u +%F)"
echo
echo "| connections | this build: requests counted | instructions per request | the build compared with | ratio |"
echo "|---|---|---|---|---|"
for c in $CONNS; do
  read -r n i <<< "$(count "this-$c" "$BIN" "$c")"
  if [ -n "${TOLLGATE_BENCH_AGAINST:-}" ]; then
    read -r _ bi <<< "$(count "before-$c" "$TOLLGATE_BENCH_AGAINST" "$c")"
    echo "| $c | $n | $i | $bi | $(python3 -c "print(f'{$i / $bi:.3f}')") |"
  else
    echo "| $c | $n | $i | | |"
  fi
done
