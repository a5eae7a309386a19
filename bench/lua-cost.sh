#!/usr/bin/env bash
# Instructions that Redis spends inside the ledger script per admission, per control and per
# admit + settle pair, counted by Valgrind (callgrind, only inside EVAL): unlike timings on a
# shared machine, the counts compare two script versions exactly. Each figure is the difference
# between a run of 1,500 and one of 500 iterations, divided by 1,000 (the script's setup cancels).
#
#   bench/lua-cost.sh [SCRIPT=the assembled ledger, bench/lua-script.sh] [B=1] [U=16] [F=64]
#
# B: items per script call. A call remembers the conversions of its items (a batch repeats the
# same limits and TTLs, and often the same scopes); B=1 is one admission per call, as with a single
# caller. U: users the requests are spread over, each its own scope (U=1: every request in one
# scope, like one API key's traffic). F: requests in flight in the admit + settle column (each
# admission settles the one admitted F before it).
#
# Needs valgrind and redis-server (apt-get install valgrind redis-server; valgrind is installed
# here when missing and run as root). Servers listen on free loopback ports and are shut down.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMON="${1:-$(bench/lua-script.sh ledger.lua)}"
B="${2:-1}"
U="${3:-16}"
F="${4:-64}"
. bench/need-valgrind.sh
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
{
  cat "$COMMON"
  # Scripts from before the per-call memos: the same tables, unused.
  grep -q '^local MEMO, PERIODS, ITEMS' "$COMMON" || echo 'local MEMO, PERIODS, ITEMS'
  # Scripts from before the per-call write-back state: nothing to write at a call's end.
  grep -q '^local function flush(' "$COMMON" || echo 'local function flush() end'
  grep -q '^local NOW_STR' "$COMMON" || echo 'local NOW_STR'
  # v5 and later: two more fixed admission arguments (repeat scopes, loop verdict) and a
  # settlement's tool calls.
  if grep -q 'n_repeat' "$COMMON"; then echo 'local V5 = true'; else echo 'local V5 = false'; fi
  cat bench/lua-cost.lua
} > "$tmp/script.lua"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
run() { # n rates leases budgets mode -> instructions inside EVAL
  local port; port=$(free_port)
  valgrind --tool=callgrind --toggle-collect=evalGenericCommand --callgrind-out-file=/dev/null \
    redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >"$tmp/vg.log" 2>&1 &
  local pid=$!
  for _ in $(seq 600); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
  local reply; reply=$(redis-cli -p "$port" --eval "$tmp/script.lua" , P "$1" q "$2" "$3" "$4" "$5" "$B" "$U" "$F")
  redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || true
  wait "$pid" || true
  [ "$reply" = ok ] || { echo "script answered: $reply" >&2; exit 1; }
  awk '/Collected :/ {gsub(",", "", $4); print $4}' "$tmp/vg.log"
}
per() { # rates leases budgets mode -> instructions per iteration
  local a b; a=$(run 500 "$@"); b=$(run 1500 "$@")
  echo $(( (b - a) / 1000 ))
}
echo "$COMMON, $(redis-server --version | awk '{print $3}'), $B items per call, $U users, $F in flight; instructions per iteration"
echo
echo "| controls | admissions only | admit + settle, $F in flight |"
echo "|---|---|---|"
for c in "0 0 0 none (duplicate check, ticket, expiry index)" "1 0 0 rate" "0 1 0 concurrency" "0 0 1 budget" "1 1 1 all three"; do
  set -- $c
  echo "| ${*:4} | $(per "$1" "$2" "$3" a) | $(per "$1" "$2" "$3" p) |"
done
