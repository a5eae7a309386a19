#!/usr/bin/env bash
# Load benchmark of the gateway, on loopback only, bounded in time.
#
#   bench/load.sh [DURATION_SECONDS=10] [CONNECTIONS=64] [ROUNDS=3]
#   TOLLGATE_BENCH_OPERATION=1 bench/load.sh ...   (adds a fifth target: the memory store with
#   a rule on the request's agent operation as well, each request naming one)
#   TOLLGATE_BENCH_SHADOW=1 bench/load.sh ...      (adds the six controls with a shadow rule and
#   alerts configured, on each store and on Redis with slices, each compared with the same
#   store's run without them)
#   TOLLGATE_BENCH_AGAINST=DIR bench/load.sh ...   (adds the pass-through, memory, Redis and sliced targets
#   served by the `tollgate` binary in DIR, an earlier build, e.g. that of a worktree at another
#   commit: `git worktree add /tmp/before REV && (cd /tmp/before && cargo build --release -p
#   tollgate)`, then DIR=/tmp/before/target/release; each under its own Redis prefix, so that
#   a change is compared with what it changed in the same run, round by round)
#   TOLLGATE_BENCH_LEDGER=1 bench/load.sh ...      (adds the six controls on Redis with the spend
#   ledger on a PostgreSQL of its own, compared with the Redis run without it, and checks that
#   the ledger holds one ending per request served)
#
# Five targets, the same wrk settings: the upstream simulator directly; the gateway with no
# scopes (parse, count, admit an empty plan, forward: "controls off"); the gateway with all six
# controls on the memory store; with all six on Redis (its own redis-server), one call per
# admission; and on the same Redis with leased slices ([store.slices]). The targets
# take turns, round after round, so that a slow moment of a shared machine falls on all of them;
# each round's ratios are taken within the round. Prints every round, then a Markdown table of
# medians (req/s, p50, p99, the median of the rounds' ratios to pass-through, the CPU time per
# request of the gateway and of Redis, read from /proc, and the share of both cores left idle
# during the run, from /proc/stat: where the cores are not saturated, work added by the
# controls costs less throughput).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-10}"
CONN="${2:-64}"
ROUNDS="${3:-3}"
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)"; exit 2; }
. bench/gateways.sh

start_targets
if [ "${TOLLGATE_BENCH_OPERATION:-0}" = 1 ]; then
  OPS=$(gateway operation "" "$WITH_OPERATION")
  TARGETS+=("operation $OPS")
fi
if [ "${TOLLGATE_BENCH_SHADOW:-0}" = 1 ]; then
  SHM=$(gateway shadow "" "$WITH_SHADOW")
  SHR=$(gateway shadow-redis "$(redis_store_toml "$REDIS")" "$WITH_SHADOW")
  SHS=$(gateway shadow-sliced "$(sliced_store_toml "$REDIS")" "$WITH_SHADOW")
  TARGETS+=("shadow $SHM" "shadow-redis $SHR" "shadow-sliced $SHS")
fi
if [ -n "${TOLLGATE_BENCH_AGAINST:-}" ]; then
  BEFORE_PASS=$(BIN="$TOLLGATE_BENCH_AGAINST" gateway before-pass "" "")
  BEFORE_MEM=$(BIN="$TOLLGATE_BENCH_AGAINST" gateway before-memory "" "$ALL_SIX")
  # One call per request: slices turned off, in a build that has them on by default (an
  # earlier build without the setting has them off unless [store.slices] is given).
  BEFORE_STORE=$(printf '[store]\nurl = "redis://127.0.0.1:%s/"\ncall_timeout = "2s"\nprefix = "before"\n' "$REDIS")
  printf '%s\n[store.slices]\nenabled = false\n' "$BEFORE_STORE" > "$tmp/before-slices-off.toml"
  if "$TOLLGATE_BENCH_AGAINST/tollgate" check --config "$tmp/before-slices-off.toml" >/dev/null 2>&1; then
    BEFORE_STORE=$(cat "$tmp/before-slices-off.toml")
  fi
  BEFORE_RED=$(BIN="$TOLLGATE_BENCH_AGAINST" gateway before-redis "$BEFORE_STORE" "$ALL_SIX")
  BEFORE_SLI=$(BIN="$TOLLGATE_BENCH_AGAINST" gateway before-sliced "$(sliced_store_toml "$REDIS" before-sliced)" "$ALL_SIX")
  TARGETS+=("before-pass $BEFORE_PASS" "before-memory $BEFORE_MEM" "before-redis $BEFORE_RED" "before-sliced $BEFORE_SLI")
fi
if [ "${TOLLGATE_BENCH_LEDGER:-0}" = 1 ]; then
  start_postgres
  LGR=$(gateway ledger-redis "$(redis_store_toml "$REDIS")
[ledger]
url = \"$PG_URL\"" "$ALL_SIX")
  TARGETS+=("ledger-redis $LGR")
fi

# CPU time (user + system, in clock ticks) a process has used so far; 0 when there is none.
ticks() { if [ -n "$1" ] && [ -r "/proc/$1/stat" ]; then awk '{print $14 + $15}' "/proc/$1/stat"; else echo 0; fi; }
HZ=$(getconf CLK_TCK)
# The whole machine's (total, idle + iowait) clock ticks so far, from /proc/stat.
machine() { awk '/^cpu / {print $2+$3+$4+$5+$6+$7+$8+$9, $5+$6}' /proc/stat; }
# The CPU ticks of the benchmark's PostgreSQL (the postmaster and its children) during the
# ledger target; 0 for the others.
pg_ticks() {
  if [ "$1" != ledger-redis ]; then echo 0; return; fi
  local s=0 p
  for p in "$PG_PID" $(ps --ppid "$PG_PID" -o pid= 2>/dev/null); do s=$((s + $(ticks "$p"))); done
  echo "$s"
}
run() { # label port -> "rps p50 p99 gateway-cpu-us-per-request redis-cpu-us-per-request idle-share"
  # CPU per request is steadier than req/s on a shared machine: it does not depend on how much
  # of the cores the other processes took during the run.
  local gw; gw=$(cat "$tmp/pid-$1" 2>/dev/null || true)
  local rd=""; case "$1" in *redis*|*sliced*) rd=$REDIS_PID ;; esac
  local g0 r0 g1 r1 m0 m1 q0 q1; g0=$(ticks "$gw"); r0=$(ticks "$rd"); m0=$(machine); q0=$(pg_ticks "$1")
  local script=bench/post.lua; [ "$1" = operation ] && script=bench/post-operation.lua
  local out; out=$(wrk -t2 -c"$CONN" -d"${DUR}s" --latency -s "$script" "http://127.0.0.1:$2/v1/chat/completions" 2>&1)
  g1=$(ticks "$gw"); r1=$(ticks "$rd"); m1=$(machine); q1=$(pg_ticks "$1")
  if echo "$out" | grep -q "Non-2xx"; then echo "$out" >&2; echo "non-2xx responses for $1" >&2; exit 1; fi
  local rps p50 p99 n
  n=$(echo "$out" | awk '/requests in/ {print $1}')
  echo "$1 $n" >> "$tmp/served"
  [ "$1" = ledger-redis ] && echo "$(python3 -c "print(round(($q1 - $q0) * 1000000 / $HZ / $n, 1))")" >> "$tmp/pg-cpu"
  rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
  p50=$(echo "$out" | awk '$1=="50%" {print $2}')
  p99=$(echo "$out" | awk '$1=="99%" {print $2}')
  local per="1000000 / $HZ / $n"
  local idle; idle=$(python3 -c "a, b = '$m0'.split(), '$m1'.split(); print(round((int(b[1]) - int(a[1])) / max(1, int(b[0]) - int(a[0])), 3))")
  echo "$rps $p50 $p99 $(python3 -c "print(round(($g1 - $g0) * $per, 1))") $(python3 -c "print(round(($r1 - $r0) * $per, 1))") $idle"
}
echo "wrk -t2 -c$CONN -d${DUR}s, $ROUNDS rounds, one small chat completion (16 output tokens), upstream simulator with no latency; $(nproc) cores shared by wrk, gateway, simulator and Redis; $(date -u +%F)"
echo
rows="$tmp/rows"
for r in $(seq "$ROUNDS"); do
  for t in "${TARGETS[@]}"; do
    set -- $t
    echo "$r $1 $(run "$1" "$2")" | tee -a "$rows"
  done
done
echo
python3 - "$rows" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
by = {}
cpu = {}
idle = {}
for r, t, rps, p50, p99, gw, rd, id_ in rows:
    by.setdefault(t, []).append((int(r), float(rps), p50, p99))
    cpu.setdefault(t, []).append((float(gw), float(rd)))
    idle.setdefault(t, []).append(float(id_))
def ms(v):  # wrk latency: 1.23ms, 456.78us, 1.02s
    for unit, f in (("us", 1e-3), ("ms", 1.0), ("s", 1e3)):
        if v.endswith(unit) and v[: -len(unit)].replace(".", "").isdigit():
            return float(v[: -len(unit)]) * f
    return float("nan")
rps = {t: {r: x for r, x, _, _ in v} for t, v in by.items()}
names = [("direct", "simulator direct"), ("pass", "gateway, controls off (pass-through)"),
         ("memory", "gateway, six controls, memory store"), ("redis", "gateway, six controls, Redis store"),
         ("redis-sliced", "gateway, six controls, Redis store with leased slices"),
         ("operation", "gateway, six controls and an operation rule, memory store"),
         ("shadow", "gateway, six controls, a shadow rule and alerts, memory store"),
         ("shadow-redis", "gateway, six controls, a shadow rule and alerts, Redis store"),
         ("shadow-sliced", "gateway, six controls, a shadow rule and alerts, Redis store with leased slices"),
         ("ledger-redis", "gateway, six controls, Redis store, spend ledger in PostgreSQL"),
         ("before-pass", "the build compared with: controls off (pass-through)"),
         ("before-memory", "the build compared with: six controls, memory store"),
         ("before-redis", "the build compared with: six controls, Redis store"),
         ("before-sliced", "the build compared with: six controls, Redis store with leased slices")]
names = [(t, label) for t, label in names if t in by]
print("| target | req/s (median) | p50 | p99 | vs pass-through (median of rounds) | per round | gateway CPU per request | Redis CPU per request | machine idle |")
print("|---|---|---|---|---|---|---|---|---|")
for t, label in names:
    v = by[t]
    ratios = [rps[t][r] / rps["pass"][r] for r in rps[t]]
    print(f"| {label} | {statistics.median(x for _, x, _, _ in v):.0f} | "
          f"{statistics.median(ms(p) for _, _, p, _ in v):.2f}ms | {statistics.median(ms(p) for _, _, _, p in v):.2f}ms | "
          f"{statistics.median(ratios):.2f}x | {' '.join(f'{x:.2f}' for x in ratios)} | "
          f"{statistics.median(g for g, _ in cpu[t]):.1f} µs | {statistics.median(r for _, r in cpu[t]):.1f} µs | "
          f"{100 * statistics.median(idle[t]):.0f}% |")
# A ratio to pass-through means something only when pass-through itself had the cores busy:
# with cores left idle, work the controls add runs on them instead of costing throughput.
# The same targets of the build compared with, round by round: this build's req/s over its.
pairs = [(t, "before-" + ("sliced" if t == "redis-sliced" else t)) for t in ("pass", "memory", "redis", "redis-sliced")]
pairs = [(t, b) for t, b in pairs if t in by and b in by]
if pairs:
    print("\n| target | this build / the build compared with (median of rounds) | per round |")
    print("|---|---|---|")
    for t, b in pairs:
        q = [rps[t][r] / rps[b][r] for r in rps[t] if r in rps[b]]
        print(f"| {t} | {statistics.median(q):.3f}x | {' '.join(f'{x:.2f}' for x in q)} |")
    # Each build's controls against its own pass-through: what the controls cost in each.
    if "before-pass" in rps:
        print("\n| target | this build's ratio to its pass-through | the compared build's to its own |")
        print("|---|---|---|")
        for t, b in pairs[1:] if pairs[0][0] == "pass" else pairs:
            mine = statistics.median(rps[t][r] / rps["pass"][r] for r in rps[t])
            theirs = statistics.median(rps[b][r] / rps["before-pass"][r] for r in rps[b] if r in rps["before-pass"])
            print(f"| {t} | {mine:.3f}x | {theirs:.3f}x |")
pass_idle = statistics.median(idle["pass"])
print(f"\npass-through left {100 * pass_idle:.0f}% of the cores idle: " +
      ("saturated, the ratios are what the controls cost at saturation" if pass_idle < 0.05 else
       "NOT saturated (something other than the CPU bounds it), the ratios flatter the controls"))
for t, base, what in (("shadow", "memory", "shadow rule and alerts"),
                      ("shadow-redis", "redis", "shadow rule and alerts"),
                      ("shadow-sliced", "redis-sliced", "shadow rule and alerts"),
                      ("ledger-redis", "redis", "spend ledger")):
    if t in rps:
        ratios = [rps[t][r] / rps[base][r] for r in rps[t]]
        print(f"\n{what} against the same run without it ({base}): "
              f"{statistics.median(ratios):.3f}x (rounds {' '.join(f'{x:.3f}' for x in ratios)})")
if "operation" in rps:
    ratios = [rps["operation"][r] / rps["memory"][r] for r in rps["operation"]]
    print(f"\nthe operation rule against the same run without it (memory store): "
          f"{statistics.median(ratios):.3f}x (rounds {' '.join(f'{x:.3f}' for x in ratios)})")
PY
if [ "${TOLLGATE_BENCH_LEDGER:-0}" = 1 ]; then
  # wrk counts what it sent in the duration; a request cut off at the end may still settle.
  served=$(awk '$1=="ledger-redis" {s+=$2} END {print s}' "$tmp/served")
  sleep 2
  rows=$(psql "$PG_URL" -tAc "select count(*) from tollgate_endings")
  echo
  echo "ledger: $rows endings written for $served requests wrk counted as completed; PostgreSQL CPU per request (rounds): $(tr '\n' ' ' < "$tmp/pg-cpu")µs"
fi
