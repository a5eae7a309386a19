#!/usr/bin/env bash
# Instructions per operation of the memory store and of plan(), next to governor's check(), counted
# by Valgrind (callgrind, only inside the bench's `measured` function): unlike timings, the
# counts do not move with a shared machine's load, so two builds compare exactly.
#
#   bench/instructions.sh [N=20000]
#
# Needs valgrind (apt-get install valgrind; installed here when missing and run as root).
set -euo pipefail
cd "$(dirname "$0")/.."
N="${1:-20000}"
. bench/need-valgrind.sh
cargo bench -q -p tollgate-core --bench instructions --no-run  # fails loudly on a build error
EXE=$(cargo bench -q -p tollgate-core --bench instructions --no-run --message-format=json 2>/dev/null \
  | python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable") and m["target"]["name"] == "instructions"][0])')
count() { # op -> instructions per operation
  local out
  out=$(valgrind --tool=callgrind --toggle-collect='instructions::measured' --callgrind-out-file=/dev/null "$EXE" "$1" "$N" 2>&1)
  echo "$out" | awk '/Collected :/ {gsub(",", "", $4); print $4}' | python3 -c "import sys; print(round(int(sys.stdin.read()) / $N))"
}
gov=$(count governor)
keyed=$(count governor_keyed)
ratio() { python3 -c "print(f'{$1 / $2:.0f}x')"; }
echo "N = $N operations each; instructions per operation (ratios to governor's direct check() and"
echo "to its keyed check_key() over 64 keys)"
echo
echo "| operation | instructions | ratio to \`check()\` | ratio to \`check_key()\` |"
echo "|---|---|---|---|"
echo "| governor \`check()\` (direct limiter) | $gov | 1x | |"
echo "| governor \`check_key()\` (keyed limiter, 64 keys) | $keyed | $(ratio "$keyed" "$gov") | 1x |"
for op in "plan1 plan(), 1 scope" "plan5 plan(), 5 scopes" "store1 admit + settle, 1 scope" "store5 admit + settle, 5 scopes" \
  "plans1 plans(), 1 scope" "plans_shadow plans(), 1 scope and a shadow rule" \
  "store_shadow admit with the shadow plan + settle, 1 scope and a shadow rule"; do
  set -- $op
  c=$(count "$1")
  shift
  echo "| $* | $c | $(ratio "$c" "$gov") | $(ratio "$c" "$keyed") |"
done
