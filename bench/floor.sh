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
#   call in flight (a perfect batch), seven commands per admission and three per call.
# The "all in one call" column has one redis-benchmark client sending calls of N admissions.
# The store's own script, with its logic, is measured by `cargo bench -p tollgate-redis --bench
# throughput`.
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
# redis-benchmark -q prints progress lines ended by \r; the last one holds the total.
rps() { tr '\r' '\n' | grep -o '[0-9.]* requests per second' | tail -1 | awk '{print $1}'; }
bench() { # clients requests command... -> calls per second
  local c=$1 n=$2
  shift 2
  redis-benchmark -p "$port" -n "$n" -c "$c" -r 100000000 -q "$@" | rps
}
P=bf
ratio() { python3 -c "print(f'{$1:.0f}/s {$1 / $2:.2f}x')"; }
echo "$(redis-server --version | awk '{print $3}'), N = $N admissions per cell, one redis-server on 127.0.0.1"
echo
echo "| callers | trivial EVALSHA | floor, one per call | floor, all in one call |"
echo "|---|---|---|---|"
for c in 1 8 64; do
  base=$(bench "$c" "$N" EVALSHA "$trivial" 0)
  f1=$(bench "$c" "$N" EVALSHA "$one" 5 $P:x $P:ts:__rand_int__ $P:r:u $P:l:u $P:b:u id__rand_int__)
  fb=$(bench 1 $((N / c)) EVALSHA "$batch" 0 "$c" id__rand_int__)
  echo "| $c | $(printf '%.0f' "$base")/s | $(ratio "$f1" "$base") | $(ratio "$fb * $c" "$base") |"
done
# No call failed (an error answers early, which would flatter it).
failed=$(redis-cli -p "$port" info commandstats | grep -o 'cmdstat_evalsha:.*failed_calls=[0-9]*' | grep -o '[0-9]*$')
[ "$failed" = 0 ] || { echo "$failed calls failed" >&2; exit 1; }
