#!/usr/bin/env bash
# Fixed-rate (open-loop) latency benchmark of the gateway, on loopback only, bounded in time.
#
#   bench/rate.sh [DURATION_SECONDS=10] [RATES="2000 5000 8000"] [ROUNDS=2] [CONNECTIONS=64]
#
# The same four targets as bench/load.sh (the simulator direct, the gateway with controls off,
# all six controls on the memory store, on Redis), each sent a fixed number of requests per
# second by oha (`-q`, with `--latency-correction`: a request's latency counts from when it was
# due, not from when a busy connection got round to sending it, so a stall shows in the tail
# instead of slowing the sender down). Targets take turns within each rate and round. Prints
# p50, p99 and p99.9 per target and rate, the rate achieved, and what each gateway adds to the
# simulator direct's p50 and p99 at the same rate in the same round (medians of the rounds).
set -euo pipefail
cd "$(dirname "$0")/.."
DUR="${1:-10}"
RATES="${2:-2000 5000 8000}"
ROUNDS="${3:-2}"
CONN="${4:-64}"
OHA_VERSION=1.16.0
OHA=$(command -v oha || true)
if [ -z "$OHA" ]; then
  OHA=target/bench-tools/bin/oha
  [ -x "$OHA" ] || cargo install -q oha --locked --version "$OHA_VERSION" --root target/bench-tools
fi
. bench/gateways.sh

start_targets
BODY='{"model":"gpt-4o","max_tokens":16,"messages":[{"role":"user","content":"Say hello in three words."}]}'

# Every target once before measuring: the first requests load tokenizers and open connections
# (the simulator's first request alone takes tens of milliseconds), which is not the steady state.
for t in "${TARGETS[@]}"; do
  set -- $t
  "$OHA" -n 2000 -c "$CONN" --no-tui --output-format quiet -m POST -H "content-type: application/json" \
    -H "authorization: Bearer sk-bench" -d "$BODY" "http://127.0.0.1:$2/v1/chat/completions"
done
echo "oha $("$OHA" --version | awk '{print $2}') -q RATE -c$CONN -z${DUR}s --latency-correction, $ROUNDS rounds, rates: $RATES; one small chat completion, upstream simulator with no latency; $(nproc) cores shared by oha, gateway, simulator and Redis; $(date -u +%F)"
echo
for r in $(seq "$ROUNDS"); do
  for q in $RATES; do
    for t in "${TARGETS[@]}"; do
      set -- $t
      "$OHA" -q "$q" -c "$CONN" -z "${DUR}s" -w --latency-correction --no-tui --output-format json \
        -m POST -H "content-type: application/json" -H "authorization: Bearer sk-bench" \
        -d "$BODY" "http://127.0.0.1:$2/v1/chat/completions" > "$tmp/out-$r-$q-$1.json"
      python3 - "$r" "$q" "$1" "$tmp/out-$r-$q-$1.json" <<'PY' | tee -a "$tmp/rows"
import json, sys
r, q, t, path = sys.argv[1:]
o = json.load(open(path))
codes = o["statusCodeDistribution"]
ok = codes.get("200", 0)
bad = sum(codes.values()) - ok + sum(o["errorDistribution"].values())
if bad:
    sys.exit(f"{t} at {q}/s: {bad} requests not answered 200: {codes} {o['errorDistribution']}")
p = o["latencyPercentiles"]
print(r, q, t, round(o["summary"]["requestsPerSec"]), *(round(p[k] * 1000, 3) for k in ("p50", "p99", "p99.9")))
PY
    done
  done
done
echo
python3 - "$tmp/rows" <<'PY'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
at = {(r, q, t): (float(rps), float(a), float(b), float(c)) for r, q, t, rps, a, b, c in rows}
names = [("direct", "simulator direct"), ("pass", "gateway, controls off (pass-through)"),
         ("memory", "gateway, six controls, memory store"), ("redis", "gateway, six controls, Redis store"),
         ("redis-sliced", "gateway, six controls, Redis store with leased slices")]
rates = sorted({int(q) for _, q, _ in at})
rounds = sorted({r for r, _, _ in at})
med = statistics.median
print("| target | rate asked | achieved | p50 | p99 | p99.9 | p50 added | p99 added (per round) |")
print("|---|---|---|---|---|---|---|---|")
for q in map(str, rates):
    for t, label in names:
        v = [at[(r, q, t)] for r in rounds]
        d = [at[(r, q, "direct")] for r in rounds]
        add50 = [x[1] - y[1] for x, y in zip(v, d)]
        add99 = [x[2] - y[2] for x, y in zip(v, d)]
        extra = " | " if t == "direct" else f"{med(add50):.2f} ms | {med(add99):.2f} ms ({' '.join(f'{a:.2f}' for a in add99)})"
        got = med(x[0] for x in v)
        # Below the rate asked, the target could not keep up: its latencies are a queue's.
        sat = " (saturated)" if got < 0.98 * int(q) else ""
        print(f"| {label} | {q}/s | {got:.0f}/s{sat} | {med(x[1] for x in v):.2f} ms | "
              f"{med(x[2] for x in v):.2f} ms | {med(x[3] for x in v):.2f} ms | {extra} |")
PY
