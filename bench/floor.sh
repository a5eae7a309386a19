#!/usr/bin/env bash
# How close to a trivial EVALSHA any script of the Redis store's design can come: admissions per
# second with redis-benchmark as the only client (no Rust, no plan, no tokio), against
# redis-benchmark's `EVALSHA` of `return 1` with the same number of callers, on one redis-server.
#
#   bench/floor.sh [N=20000]
#
# Columns, each as admissions per second and as a ratio to the trivial call:
# - floor, one per call: bench/floor/one.lua, the eleven commands one admission with a rate, a
#   concurrency and a budget limit needs (time, sweep, rate read and write, expired leases out,
#   lease count, lease, budget read and reservation, ticket, expiry index), no logic;
# - floor, all in one call: bench/floor/batch.lua, every caller's admission in one call with one
#   call in flight (a perfect batch), seven commands per admission and three per call;
# - ledger, one per call: the store's own batch script (common_v7 + batch_v4) with one admission,
#   the throughput bench's policy and arguments;
# - ledger, all in one call: the same script with every caller's admission in one call, users
#   spread over 16 as in the throughput bench.
# The "all in one call" columns have one redis-benchmark client sending calls of N admissions.
#
# Needs redis-server, redis-cli and redis-benchmark. The server listens on a free loopback port
# and is shut down.
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-20000}"
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
port=$(free_port)
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no >/dev/null 2>&1 &
pid=$!
trap 'redis-cli -p "$port" shutdown nosave >/dev/null 2>&1 || kill "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 100); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
load() { redis-cli -p "$port" SCRIPT LOAD "$1"; }
trivial=$(load 'return 1')
one=$(load "$(cat bench/floor/one.lua)")
batch=$(load "$(cat bench/floor/batch.lua)")
ledger=$(load "$(cat "$(bench/lua-script.sh batch.lua)")")
# redis-benchmark -q prints progress lines ended by \r; the last one holds the total.
rps() { tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -1 | awk '{print $1}'; }
bench() { # clients requests command... -> calls per second
  local c=$1 n=$2
  shift 2
  redis-benchmark -p "$port" -n "$n" -c "$c" -r 100000000 -q "$@" | rps
}
P=bf
# One admission as batch_v4 takes it (see bench/call-cost.sh): op, argument count, then the
# throughput bench's: id, ttl, retention, token verdict, one rate, lease and budget scope, price,
# expired usage, three kill-switch targets, no repeats, no loop verdict, the three scopes.
item() { # user [id] -> the item's arguments
  local u="user|tenant:acme/user:u$1" id="${2:-b__rand_int__}"
  echo "a 30 $id 60000 3600000 0 1 1 1 0 0 0 100 0 100 3 0 0 all tenant:acme user:u$1" \
    "$P:r:$u 1000000000 60000 $P:l:$u 1000000 $P:b:$u 1000000000000 t 86400000 fixed:86400000 200"
}
item_keys() { local u="user|tenant:acme/user:u$1"; echo "$P:ts:${2:-b__rand_int__} $P:r:$u $P:l:$u $P:b:$u"; }
ratio() { python3 -c "print(f'{$1:.0f}/s {$1 / $2:.2f}x')"; }
echo "$(redis-server --version | awk '{print $3}'), N = $N admissions per cell, one redis-server on 127.0.0.1"
echo
echo "| callers | trivial EVALSHA | floor, one per call | floor, all in one call | ledger, one per call | ledger, all in one call |"
echo "|---|---|---|---|---|---|"
for c in 1 8 64; do
  base=$(bench "$c" "$N" EVALSHA "$trivial" 0)
  f1=$(bench "$c" "$N" EVALSHA "$one" 5 $P:x $P:ts:__rand_int__ $P:r:u $P:l:u $P:b:u id__rand_int__)
  fb=$(bench 1 $((N / c)) EVALSHA "$batch" 0 "$c" id__rand_int__)
  # shellcheck disable=SC2046
  l1=$(bench "$c" "$N" EVALSHA "$ledger" 9 $P:x $P:clock $P:kill $P:marker $P:lost $(item_keys 0) $P 0 3600000 0 $(item 0))
  keys="" args="" check_keys="" check_args=""
  for i in $(seq 0 $((c - 1))); do
    keys="$keys $(item_keys $((i % 16)))"
    args="$args $(item $((i % 16)))"
    check_keys="$check_keys $(item_keys $((i % 16)) "check-$c-$i")"
    check_args="$check_args $(item $((i % 16)) "check-$c-$i")"
  done
  # The call must admit all its items: a refusal or an error would flatter it.
  # shellcheck disable=SC2086
  admitted=$(redis-cli -p "$port" EVALSHA "$ledger" $((5 + 4 * c)) $P:x $P:clock $P:kill $P:marker $P:lost $check_keys \
    $P 0 3600000 0 $check_args | grep -cx admit || true)
  [ "$admitted" = "$c" ] || { echo "a call of $c admissions admitted $admitted" >&2; exit 1; }
  # shellcheck disable=SC2086
  lb=$(bench 1 $((N / c)) EVALSHA "$ledger" $((5 + 4 * c)) $P:x $P:clock $P:kill $P:marker $P:lost $keys $P 0 3600000 0 $args)
  echo "| $c | $(printf '%.0f' "$base")/s | $(ratio "$f1" "$base") | $(ratio "$fb * $c" "$base") | $(ratio "$l1" "$base") | $(ratio "$lb * $c" "$base") |"
done
# No call failed (an error answers early, which would flatter it).
failed=$(redis-cli -p "$port" info commandstats | grep -o 'cmdstat_evalsha:.*failed_calls=[0-9]*' | grep -o '[0-9]*$')
[ "$failed" = 0 ] || { echo "$failed calls failed" >&2; exit 1; }
