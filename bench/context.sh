#!/usr/bin/env bash
# Agent-scale prompts: what the gateway adds to requests of about 1k, 10k and 100k input tokens,
# to each turn of an agent loop whose history grows to about 100k tokens, and to small streamed
# turns' time to first byte while two other clients send 100k-token requests. The baseline is
# the upstream simulator (no latency) called directly in the same run, request by request.
# Sequential requests, loopback only; stops by itself.
#
#   bench/context.sh [REPEATS=15]
#
# The gateway runs the six controls on the memory store, with input and total limits above the
# largest request (every token is counted); once with its defaults and once keeping no counts
# between requests (`count_memo_entries = 0`), the figures before the memo.
set -euo pipefail
cd "$(dirname "$0")/.."
REPEATS="${1:-15}"
. bench/gateways.sh
start_upstreams
POLICY=$(printf '%s\n' "$ALL_SIX" | sed 's/^input_tokens = 100000$/input_tokens = 300000/; s/^total_tokens = 200000$/total_tokens = 400000/')
GW=$(gateway context "" "$POLICY")
OFF=$(SERVER_EXTRA="count_memo_entries = 0" gateway context-no-memo "" "$POLICY")
echo "bench/context.sh $REPEATS: gateway (six controls, memory store) against the simulator directly, $(date -u +%F)"
for run in "default (counts of long texts kept per tenant)|$GW" "count_memo_entries = 0 (every text counted every time)|$OFF"; do
  echo
  echo "Gateway: ${run%%|*}"
  echo
  echo "| case | median added by the gateway | simulator direct |"
  echo "|---|---|---|"
  python3 bench/context.py "${run##*|}" "$SIM" "$REPEATS"
done
