#!/usr/bin/env bash
# Instructions that Redis spends on one script call of the Redis store, whatever the call
# carries, counted by Valgrind (callgrind, only inside EVALSHA): `redis-benchmark` sends one call
# at a time; each figure is the difference between 1,500 and 500 calls, divided by 1,000.
#
#   bench/call-cost.sh [COMMON=the assembled ledger] [BATCH=crates/redis/src/lua/batch_v5.lua]
#
# Rows: `return 1` (the floor); the ledger's definitions, then `return 1` (Redis runs a script
# from the top on every call, so every function is made again each time); a batch call with no
# items (the store's time, the sweep, the final flush); a batch call with one admission of one
# user with a rate, a concurrency and a budget limit, a new request id each time (as a single
# caller's call). The admission's arguments are written out below in batch_v4's format; the
# script checks that the call admits before it counts.
#
# Needs valgrind, redis-server and redis-benchmark (valgrind is installed here when missing and
# run as root). Servers listen on free loopback ports and are shut down.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMON="${1:-$(bench/lua-script.sh ledger.lua)}"
BATCH="${2:-crates/redis/src/lua/batch_v5.lua}"
. bench/need-valgrind.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo 'return 1' > "$tmp/return1.lua"
{ cat "$COMMON"; echo 'return 1'; } > "$tmp/definitions.lua"
{ cat "$COMMON"; cat "$BATCH"; } > "$tmp/batch.lua"
# batch_v4: prefix, now (0: Redis TIME), retention, whether the marker was seen (0: the first
# call writes it), then the item: op, its argument count, and
# admit_one's arguments: id, ttl, retention, token verdict, 1 rate, 1 lease and 1 budget scope,
# price (3), expired usage (3), no kill targets, no repeats, no loop verdict, the rate scope (key, limit, window), the lease
# scope (key, limit), the budget scope (key, limit, unit, period, label, amount).
ADMIT=(P 0 3600000 0 a 27 id__rand_int__ 60000 3600000 0 1 1 1 0 0 0 100 0 100 0 0 0
  P:r:u 1000000000 60000 P:l:u 1000000 P:b:u 1000000000000 t 86400000 user 200)
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
run() { # calls script args... -> instructions inside EVALSHA
  local n=$1 script=$2 port pid sha
  shift 2
  port=$(free_port)
  valgrind --tool=callgrind --toggle-collect=evalGenericCommand --callgrind-out-file=/dev/null \
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$tmp/vg.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
  sha=$(redis-cli -p "$port" SCRIPT LOAD "$(cat "$script")")
  if [ "${1:-}" = P ] && [ "${5:-}" = a ]; then
    # One call first, outside the count's difference: it must admit.
    redis-cli -p "$port" EVALSHA "$sha" 0 "${@/__rand_int__/check}" | grep -qx admit \
      || { echo "the admission was not admitted" >&2; exit 1; }
  fi
  redis-benchmark -p "$port" -n "$n" -c 1 -r 100000000 -q EVALSHA "$sha" 0 "$@" >/dev/null
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$pid" || true
  awk '/Collected :/ {gsub(",", "", $4); print $4}' "$tmp/vg.log"
}
per() { local a b; a=$(run 500 "$@"); b=$(run 1500 "$@"); echo $(( (b - a) / 1000 )); }
echo "$COMMON + $BATCH, $(redis-server --version | awk '{print $3}'); instructions per call"
echo
echo "| call | instructions |"
echo "|---|---|"
echo "| \`return 1\` | $(per "$tmp/return1.lua") |"
echo "| the ledger's definitions, then \`return 1\` | $(per "$tmp/definitions.lua" P) |"
echo "| a batch call with no items | $(per "$tmp/batch.lua" P 0 3600000 0) |"
echo "| a batch call with one admission (three controls) | $(per "$tmp/batch.lua" "${ADMIT[@]}") |"
