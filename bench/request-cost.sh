#!/usr/bin/env bash
# Instructions per request of the gateway and of Redis, counted by Valgrind (callgrind) while
# wrk sends the load benchmark's request: unlike req/s or CPU time on a shared machine, the
# counts of two builds compare within a few per cent from one run to the next, so a change of
# the request path shows in them even when load.sh's rounds scatter.
#
#   bench/request-cost.sh [MODE=redis] [DUR=20] [DIR=an earlier build's target/release]
#
# MODE: pass (controls off), memory (six controls on the memory store) or redis (six controls
# on Redis, one call per admission). Both processes run under Valgrind, about fifty times
# slower than natively: batches are smaller than at saturation, so a script call's fixed cost
# weighs more here than in load.sh. The tokenizers are warmed up first (a 25 s load the counts
# leave out). With DIR, the same is measured for that build, e.g. a worktree at another commit
# (see load.sh's TOLLGATE_BENCH_AGAINST), and both are printed.
#
# Needs valgrind, wrk and redis-server. Everything listens on free loopback ports and stops.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-redis}"
DUR="${2:-20}"
AGAINST="${3:-}"
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)"; exit 2; }
. bench/need-valgrind.sh
cargo build --release -q -p tollgate -p tollgate-sim
tmp=$(mktemp -d)
pids=()
BIN=target/release
. bench/gateways.sh
trap cleanup EXIT

# measure LABEL BINDIR: prints "LABEL requests gateway-instructions-per-request redis-…".
measure() {
  local label=$1 bin=$2 sim redis rpid port gpid store="" policy="$ALL_SIX"
  sim=$(free_port)
  "$bin/tollgate-sim" --listen "127.0.0.1:$sim" --latency-ms 0 --token-delay-ms 0 --output-tokens 16 >/dev/null &
  pids+=($!)
  wait_port "$sim"
  redis=$(free_port)
  valgrind --tool=callgrind --callgrind-out-file="$tmp/$label-redis.out" \
    redis-server --port "$redis" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
  rpid=$!
  pids+=($!)
  wait_port "$redis" 300
  case $MODE in
    pass) policy="" ;;
    memory) ;;
    # The store's timeout is long: everything is slow under Valgrind. A build from before
    # slices were on by default takes no [store.slices] section, and needs none.
    redis) store=$(printf '[store]\nurl = "redis://127.0.0.1:%s/"\ncall_timeout = "20s"\n' "$redis")
      "$bin/tollgate" check --config <(printf '%s\n[store.slices]\nenabled = false\n' "$store") >/dev/null 2>&1 \
        && store=$(printf '%s\n[store.slices]\nenabled = false\n' "$store") ;;
    *) echo "MODE is pass, memory or redis"; exit 2 ;;
  esac
  port=$(free_port)
  BIN=$bin gateway_config "$label" "$port" "$sim" "$store" "$policy"
  BIN=$bin init_store "$label" "$store"
  valgrind --tool=callgrind --callgrind-out-file="$tmp/$label-gw.out" \
    "$bin/tollgate" serve --config "$tmp/$label.toml" >/dev/null 2>&1 &
  gpid=$!
  echo "$gpid" >> "$tmp/gateway-pids"
  wait_port "$port" 600
  wrk -t1 -c4 -d25s -s bench/post.lua "http://127.0.0.1:$port/v1/chat/completions" >/dev/null 2>&1 || true
  callgrind_control -z "$gpid" >/dev/null 2>&1
  callgrind_control -z "$rpid" >/dev/null 2>&1
  local out n
  out=$(wrk -t1 -c16 -d"${DUR}s" -s bench/post.lua "http://127.0.0.1:$port/v1/chat/completions" 2>&1)
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  callgrind_control -d "$gpid" >/dev/null 2>&1
  callgrind_control -d "$rpid" >/dev/null 2>&1
  sleep 1
  per() { # callgrind output file -> instructions per request (0 without one)
    local f; f=$(ls "$1".* 2>/dev/null | head -1)
    [ -n "$f" ] || { echo 0; return; }
    awk -v n="$n" '/^(summary|totals):/ {printf "%d\n", $2 / n; exit}' "$f"
  }
  local g r
  g=$(per "$tmp/$label-gw.out")
  r=0
  [ "$MODE" = redis ] && r=$(per "$tmp/$label-redis.out")
  echo "$label $n $g $r"
  kill "$gpid" "$rpid" 2>/dev/null || true
}

echo "mode $MODE, wrk -t1 -c16 -d${DUR}s under Valgrind; instructions per request"
echo
echo "| build | requests | gateway | Redis |"
echo "|---|---|---|---|"
rows=("$(measure this "$BIN")")
[ -n "$AGAINST" ] && rows+=("$(measure before "$AGAINST")")
for row in "${rows[@]}"; do
  set -- $row
  echo "| $1 | $2 | $3 | $4 |"
done
