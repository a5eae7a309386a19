#!/usr/bin/env bash
# Instructions the gateway process spends per request under load, counted by Valgrind
# (callgrind, user space only), for pass-through (no scopes), all six controls on the memory
# store, all six on Redis one call per admission, and on Redis with leased slices: what the controls add to a request, in a unit that a shared
# machine's load does not move (bench/load.sh measures the same setups in requests per second).
#
#   bench/gateway-cost.sh [DURATION_SECONDS=10] [CONNECTIONS=64]
#   TOLLGATE_BENCH_SHADOW=1 bench/gateway-cost.sh ...   (adds the six controls with a shadow rule
#   and alerts configured on each store, each compared with the same store without them)
#   TOLLGATE_BENCH_LEDGER=1 bench/gateway-cost.sh ...   (adds Redis with the spend ledger on a
#   PostgreSQL of its own, compared with Redis without it: the gateway's part of the ledger)
#   TOLLGATE_BENCH_AGAINST=DIR bench/gateway-cost.sh ... (counts the pass-through, memory, Redis
#   and sliced setups of the `tollgate` binary in DIR as well, an earlier build: see load.sh)
#
# Each gateway runs under callgrind; wrk sends the load bench's request (bench/post.lua) over
# CONNECTIONS connections for DURATION seconds after a warm-up, and the count covers exactly that
# window (callgrind_control zeroes the counters before it and dumps them after). Under Valgrind
# the gateway runs many times slower while the simulator and Redis do not, so the Redis store's
# batch calls carry a different number of items than at full speed, sharing each call's own
# cost differently. Kernel time (syscalls) is not counted.
#
# Needs valgrind, wrk and redis-server (valgrind is installed here when missing and run as
# root). Everything listens on free loopback ports and is stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-10}"
CONN="${2:-64}"
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)"; exit 2; }
. bench/need-valgrind.sh
. bench/gateways.sh

start_upstreams

# Waits (up to two minutes) until process $1 has used under 30 ms of CPU in a second: the
# gateway loads its tokenizers' vocabularies on a thread of their own at start-up, which under
# Valgrind takes longer than the warm-up, and counted within the window it made the figures
# follow the machine's speed.
quiet() {
  local i a b
  for i in $(seq 120); do
    a=$(awk '{print $14 + $15}' "/proc/$1/stat"); sleep 1; b=$(awk '{print $14 + $15}' "/proc/$1/stat")
    [ $((b - a)) -lt $(($(getconf CLK_TCK) * 3 / 100)) ] && return 0
  done
}

count() { # name store policy -> "requests instructions-per-request"
  local port; port=$(free_port)
  gateway_config "$1" "$port" "$SIM" "$2" "$3"
  init_store "$1" "$2"
  # One worker thread: under Valgrind threads take turns anyway, and a second worker's search for
  # work costs instructions that follow the clock, not the requests (they doubled the counts).
  TOKIO_WORKER_THREADS=1 valgrind --tool=callgrind --callgrind-out-file="$tmp/$1.cg.%p" \
    "$BIN/tollgate" serve --config "$tmp/$1.toml" >/dev/null 2>"$tmp/$1.valgrind.log" &
  local vg=$!
  pids+=($vg)
  wait_port "$port" 600
  local url="http://127.0.0.1:$port/v1/chat/completions"
  wrk -t2 -c"$CONN" -d3s -s bench/post.lua "$url" >/dev/null
  quiet "$vg"
  callgrind_control -z "$vg" >/dev/null 2>&1
  local out; out=$(wrk -t2 -c"$CONN" -d"${DUR}s" -s bench/post.lua "$url")
  callgrind_control -d "$vg" >/dev/null 2>&1
  kill "$vg"; wait "$vg" 2>/dev/null || true
  if echo "$out" | grep -q "Non-2xx"; then echo "$out" >&2; echo "non-2xx responses for $1" >&2; exit 1; fi
  local n; n=$(echo "$out" | awk '/requests in/ {print $1}')
  # The dump after zeroing is part 1; the file written at exit holds only the shutdown.
  local total; total=$(callgrind_annotate "$tmp/$1.cg.$vg.1" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')
  echo "$n $((total / n))"
}

echo "gateway instructions per request (callgrind), wrk -t2 -c$CONN -d${DUR}s after a 3 s warm-up; $(date -u +%F)"
echo
read -r pn pi <<< "$(count pass "" "")"
rows=("memory|gateway, six controls, memory store|$(count memory "" "$ALL_SIX")"
      "redis|gateway, six controls, Redis store|$(count redis "$(redis_store_toml "$REDIS")" "$ALL_SIX")"
      "redis-sliced|gateway, six controls, Redis store with leased slices|$(count redis-sliced "$(sliced_store_toml "$REDIS")" "$ALL_SIX")")
if [ "${TOLLGATE_BENCH_SHADOW:-0}" = 1 ]; then
  rows+=("shadow|gateway, six controls, a shadow rule and alerts, memory store|$(count shadow "" "$WITH_SHADOW")"
         "shadow-redis|gateway, six controls, a shadow rule and alerts, Redis store|$(count shadow-redis "$(redis_store_toml "$REDIS")" "$WITH_SHADOW")"
         "shadow-sliced|gateway, six controls, a shadow rule and alerts, Redis store with leased slices|$(count shadow-sliced "$(sliced_store_toml "$REDIS")" "$WITH_SHADOW")")
fi
if [ -n "${TOLLGATE_BENCH_AGAINST:-}" ]; then
  # As in load.sh: one call per request is slices turned off, in a build that has the setting.
  before_store=$(printf '[store]\nurl = "redis://127.0.0.1:%s/"\ncall_timeout = "2s"\nprefix = "before"\n' "$REDIS")
  printf '%s\n[store.slices]\nenabled = false\n' "$before_store" > "$tmp/before-slices-off.toml"
  if "$TOLLGATE_BENCH_AGAINST/tollgate" check --config "$tmp/before-slices-off.toml" >/dev/null 2>&1; then
    before_store=$(cat "$tmp/before-slices-off.toml")
  fi
  before() { BIN="$TOLLGATE_BENCH_AGAINST" count "$@"; }
  rows+=("before-pass|the build compared with: controls off (pass-through)|$(before before-pass "" "")"
         "before-memory|the build compared with: six controls, memory store|$(before before-memory "" "$ALL_SIX")"
         "before-redis|the build compared with: six controls, Redis store|$(before before-redis "$before_store" "$ALL_SIX")"
         "before-sliced|the build compared with: six controls, Redis store with leased slices|$(before before-sliced "$(sliced_store_toml "$REDIS" before-sliced)" "$ALL_SIX")")
fi
if [ "${TOLLGATE_BENCH_LEDGER:-0}" = 1 ]; then
  start_postgres
  rows+=("ledger-redis|gateway, six controls, Redis store, spend ledger in PostgreSQL|$(count ledger-redis "$(redis_store_toml "$REDIS")
[ledger]
url = \"$PG_URL\"" "$ALL_SIX")")
fi
echo "| setup | requests counted | instructions per request | added to pass-through | pass-through / setup |"
echo "|---|---|---|---|---|"
echo "| gateway, controls off (pass-through) | $pn | $pi | — | 1.000 |"
declare -A per
for row in "${rows[@]}"; do
  IFS='|' read -r name label counted <<< "$row"
  read -r n i <<< "$counted"
  per[$name]=$i
  echo "| $label | $n | $i | +$((i - pi)) | $(python3 -c "print(f'{$pi / $i:.3f}')") |"
done
# The earlier build's setups over its own pass-through, beside this build's.
if [ -n "${per[before-pass]:-}" ]; then
  echo
  echo "| setup | pass-through / setup, this build | the build compared with |"
  echo "|---|---|---|"
  for name in memory redis redis-sliced; do
    b=before-$name; [ "$name" = redis-sliced ] && b=before-sliced
    echo "| $name | $(python3 -c "print(f'{$pi / ${per[$name]}:.3f}')") | $(python3 -c "print(f'{${per[before-pass]} / ${per[$b]}:.3f}')") |"
  done
fi
# What a shadow rule and alerts, or the ledger, add to the same store's request, in the gateway.
for pair in "shadow memory" "shadow-redis redis" "shadow-sliced redis-sliced" "ledger-redis redis"; do
  set -- $pair
  [ -n "${per[$1]:-}" ] || continue
  what="a shadow rule and alerts"; [ "$1" = ledger-redis ] && what="the spend ledger"
  echo
  echo "$what against the same store without them ($2): +$((per[$1] - per[$2])) instructions per request, $(python3 -c "print(f'{${per[$1]} / ${per[$2]}:.3f}')")x"
done
