#!/usr/bin/env bash
# Prints the path of one of the Redis store's assembled scripts (the build script writes them:
# the common state, the controls' files and the ledger, with the argument contract's names
# replaced by offsets): ledger.lua (the functions alone), batch.lua, renew.lua, usage.lua or
# sweep.lua.
#
#   bench/lua-script.sh [NAME=ledger.lua]
set -euo pipefail
cd "$(dirname "$0")/.."
NAME="${1:-ledger.lua}"
out=$(cargo build -q -p tollgate-redis --message-format=json \
  | python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "build-script-executed" and "tollgate-redis" in m.get("package_id", ""):
        print(m["out_dir"])')
[ -f "$out/$NAME" ] || { echo "no script $NAME in $out" >&2; exit 2; }
echo "$out/$NAME"
