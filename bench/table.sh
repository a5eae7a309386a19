#!/usr/bin/env bash
# The table peers publish, on this machine: for each workload, what a gateway adds to the time
# of a request (p50 and p99, against the simulator answered directly in the same trial) and
# the requests a second it serves, with governance on and off; then peak RSS, the image's size
# and the cold start. Loopback only, bounded in time: each run lasts SECONDS (the 100k-token
# prompt's twice that).
#
#   bench/table.sh [SECONDS=4] [CLIENTS=10] [TRIALS=2]
#   TOLLGATE_TABLE_LITELLM=DIR bench/table.sh ...  (adds the LiteLLM proxy of the venv in DIR,
#   `python3 -m venv DIR && DIR/bin/pip install 'litellm[proxy]'`, in front of the same
#   simulator: one worker, no retries, its master key, a rate on the model and an in-process
#   budget, never reached; its per-key budgets need its database, through Prisma, which the
#   `proxy` extra does not install)
#   TOLLGATE_TABLE_WORKLOADS="chat keys" bench/table.sh ...  (those workloads only)
#   TOLLGATE_TABLE_SLICES=off bench/table.sh ...  (`governed` makes one Redis call per request)
#
# Setups: `direct` (the upstream simulator, no latency, 16 output tokens), `pass` (the gateway
# with no rule: parse, count, forward) and `governed` (all six controls on a per-key rule, two
# instances sharing one Redis with its default settings, each client thread sending to one of
# them). Workloads: a chat turn, a stream, a tool-call turn, prompts of about 1k, 10k and 100k
# tokens, and a flood over 1,000 keys. The setups run
# in a new random order in each trial; wrk makes no retries and the gateway has none to make.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH="${1:-4}"
CLIENTS="${2:-10}"
TRIALS="${3:-2}"
command -v wrk >/dev/null || { echo "wrk is needed (apt-get install wrk)"; exit 2; }
. bench/gateways.sh
KEYS=1000

start_upstreams

# The policy: the six controls on a per-key rule, with limits the benchmark never reaches, and
# room for the 100k-token prompt.
POLICY='
[[policy.scopes]]
name = "per-key"
key = "key"
requests = { limit = 100000000, window = "1m" }
input_tokens = 200000
output_tokens = { max = 4096, mode = "clamp" }
total_tokens = 400000
concurrency = { limit = 100000, lease_ttl = "1m" }
budget = { tokens = 1000000000000, period = "day" }
'
# sk-bench and sk-bench-0 … sk-bench-999, each its own key.
python3 - "$KEYS" > "$tmp/keys.toml" <<'PY'
import hashlib, sys
for s in ["sk-bench"] + [f"sk-bench-{i}" for i in range(int(sys.argv[1]))]:
    print(f'[[keys]]\nhash = "sha256:{hashlib.sha256(s.encode()).hexdigest()}"\ntenant = "bench"\n')
PY

# serve NAME STORE_TOML POLICY_TOML: a gateway in front of $SIM with every key; prints its port.
serve() {
  local port; port=$(free_port)
  cat > "$tmp/$1.toml" <<TOML
$2
$3
[server]
listen = "127.0.0.1:$port"
max_connections = 4096
max_connections_per_ip = 4096
[[upstreams]]
name = "sim"
base_url = "http://127.0.0.1:$SIM"
models = ["gpt-4o"]
TOML
  cat "$tmp/keys.toml" >> "$tmp/$1.toml"
  case "$2" in *redis://*) "$BIN/tollgate" admin init-store --config "$tmp/$1.toml" >/dev/null 2>&1 || true ;; esac
  "$BIN/tollgate" serve --config "$tmp/$1.toml" >/dev/null 2>&1 &
  echo $! >> "$tmp/gateway-pids"
  echo $! > "$tmp/pid-$1"
  wait_port "$port"
  echo "$port"
}

STORE=$(printf '[store]\nurl = "redis://127.0.0.1:%s/"\ncall_timeout = "2s"\nprefix = "table"\n' "$REDIS")
[ "${TOLLGATE_TABLE_SLICES:-on}" = off ] && STORE=$(printf '%s\n[store.slices]\nenabled = false\n' "$STORE")
PASS=$(serve pass "" "")
GOV_A=$(serve governed-a "$STORE" "$POLICY")
GOV_B=$(serve governed-b "$STORE" "$POLICY")
declare -A ADDRS=(
  [direct]="127.0.0.1:$SIM"
  [pass]="127.0.0.1:$PASS"
  [governed]="127.0.0.1:$GOV_A,127.0.0.1:$GOV_B"
)
SETUPS=(direct pass governed)
if [ -n "${TOLLGATE_TABLE_LITELLM:-}" ]; then
  LPORT=$(free_port)
  cat > "$tmp/litellm.yaml" <<YAML
model_list:
  - model_name: gpt-4o
    litellm_params:
      model: openai/gpt-4o
      api_base: http://127.0.0.1:$SIM/v1
      api_key: sk-sim
      rpm: 100000000
litellm_settings:
  num_retries: 0
  request_timeout: 30
  max_budget: 1000000
general_settings:
  master_key: sk-table-litellm-master-key-0123456789
YAML
  "$TOLLGATE_TABLE_LITELLM/bin/litellm" --config "$tmp/litellm.yaml" --host 127.0.0.1 --port "$LPORT" --num_workers 1 >"$tmp/litellm.log" 2>&1 &
  echo $! >> "$tmp/gateway-pids"
  echo $! > "$tmp/pid-litellm"
  wait_port "$LPORT" 600
  ADDRS[litellm]="127.0.0.1:$LPORT"
  SETUPS+=(litellm)
fi

read -r -a WORKLOADS <<< "${TOLLGATE_TABLE_WORKLOADS:-chat stream tools prompt1k prompt10k prompt100k keys}"
THREADS=2
[ "$CLIENTS" -lt 2 ] && THREADS=1
run() { # run SETUP WORKLOAD -> one JSON line
  local d="${SECONDS_EACH}"
  [ "$2" = prompt100k ] && d=$((SECONDS_EACH * 2))
  local only=()
  [ "$1" = litellm ] && only=(TABLE_ONLY_KEY=sk-table-litellm-master-key-0123456789)
  env "${only[@]}" TABLE_WORKLOAD="$2" TABLE_ADDRS="${ADDRS[$1]}" TABLE_KEYS="$KEYS" \
    wrk -t "$THREADS" -c "$CLIENTS" -d "${d}s" --timeout 30s -s bench/table.lua \
    "http://${ADDRS[$1]%%,*}/v1/chat/completions" 2>/dev/null \
    | grep '^{' || echo '{"down":true}'
}

# Each workload once on each setup before the trials: the tokenizers load, the keys' scopes
# and the memo of counts exist, connections are made.
for s in "${SETUPS[@]}"; do
  for w in "${WORKLOADS[@]}"; do SECONDS_EACH=1 run "$s" "$w" >/dev/null; done
done

: > "$tmp/results"
for t in $(seq "$TRIALS"); do
  order=$(printf '%s\n' "${SETUPS[@]}" | shuf | tr '\n' ' ')
  echo "trial $t: $order" >&2
  for w in "${WORKLOADS[@]}"; do
    for s in $order; do
      echo "$t $w $s $(run "$s" "$w")" >> "$tmp/results"
    done
  done
done

# Peak RSS (VmHWM) of each process over the whole run.
peak() { awk '/VmHWM/ {printf "%.0f", $2/1024}' "/proc/$(cat "$tmp/pid-$1")/status" 2>/dev/null || echo 0; }
PEAK_PASS=$(peak pass)
PEAK_GOV=$(( $(peak governed-a) > $(peak governed-b) ? $(peak governed-a) : $(peak governed-b) ))
PEAK_LITELLM=""
[ -n "${TOLLGATE_TABLE_LITELLM:-}" ] && PEAK_LITELLM=$(peak litellm)

# Cold start of the demo to its first /healthz answer, the median of five.
cold() {
  python3 - "$BIN/tollgate" <<'PY'
import socket, statistics, subprocess, sys, time
times = []
for _ in range(5):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.argv[1], "serve", "--demo", "--listen", f"127.0.0.1:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while True:
        try:
            c = socket.create_connection(("127.0.0.1", port), timeout=1)
            c.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            if b" 200 " in c.recv(64):
                break
        except OSError:
            pass
        if time.perf_counter() - t0 > 10:
            sys.exit("no /healthz within 10 s")
        time.sleep(0.0005)
    times.append((time.perf_counter() - t0) * 1000)
    p.terminate(); p.wait()
print(f"{statistics.median(times):.0f}")
PY
}
COLD=$(cold)

# The image: the static binary of scripts/release where it was built, else the release build;
# built FROM scratch with podman where podman is installed.
IMAGE="-"
BINARY_MB=$(du -m --apparent-size "$BIN/tollgate" | cut -f1)
if command -v podman >/dev/null 2>&1; then
  ctx="$tmp/image"
  mkdir -p "$ctx/dist" "$ctx/deploy/compose"
  if [ -x dist/tollgate ]; then cp dist/tollgate "$ctx/dist/"; IMAGE_FROM="dist/tollgate (static)"; else cp "$BIN/tollgate" "$ctx/dist/"; IMAGE_FROM="$BIN/tollgate"; fi
  cp deploy/Dockerfile "$ctx/deploy/"
  cp deploy/compose/gateway.toml "$ctx/deploy/compose/"
  podman build -q -f deploy/Dockerfile -t localhost/tollgate-table "$ctx" >/dev/null
  IMAGE=$(( $(podman image inspect localhost/tollgate-table --format '{{.Size}}') / 1000000 ))
  podman rmi localhost/tollgate-table >/dev/null
fi

python3 - "$tmp/results" "$PEAK_PASS" "$PEAK_GOV" "$COLD" "$IMAGE" "$BINARY_MB" "${PEAK_LITELLM:-}" "${IMAGE_FROM:-}" <<'PY'
import json, statistics, sys
path, peak_pass, peak_gov, cold, image, binary, peak_litellm, image_from = sys.argv[1:9]
rows = {}
for line in open(path):
    t, w, s, j = line.split(" ", 3)
    rows.setdefault((w, s), {})[t] = json.loads(j)
workloads = list(dict.fromkeys(w for w, _ in rows))
setups = [s for s in ["direct", "pass", "governed", "litellm"] if any(k[1] == s for k in rows)]
def med(xs): return statistics.median(xs)
print("| workload | setup | req/s | p50 ms | p99 ms | p50 added ms | p99 added ms | req/s vs pass | errors |")
print("|---|---|---|---|---|---|---|---|---|")
for w in workloads:
    for s in setups:
        r = rows[(w, s)]
        if any(v.get("down") for v in r.values()):
            print(f"| {w} | {s} | did not answer (the process had exited) | | | | | | |")
            continue
        trials = sorted(r)
        rps = med([r[t]["requests"] / r[t]["seconds"] for t in trials])
        p50 = med([r[t]["p50_us"] for t in trials]) / 1000
        p99 = med([r[t]["p99_us"] for t in trials]) / 1000
        add50 = med([(r[t]["p50_us"] - rows[(w, "direct")][t]["p50_us"]) / 1000 for t in trials])
        add99 = med([(r[t]["p99_us"] - rows[(w, "direct")][t]["p99_us"]) / 1000 for t in trials])
        vs = med([(r[t]["requests"] / r[t]["seconds"]) / (rows[(w, "pass")][t]["requests"] / rows[(w, "pass")][t]["seconds"]) for t in trials])
        errs = sum(r[t]["errors"] + r[t]["status_errors"] for t in trials)
        direct = s == "direct"
        print(f"| {w} | {s} | {rps:,.0f} | {p50:.2f} | {p99:.2f} | {'-' if direct else f'{add50:.2f}'} | {'-' if direct else f'{add99:.2f}'} | {'-' if direct else f'{vs:.2f}x'} | {errs} |")
print()
print("| process | peak RSS MB |")
print("|---|---|")
print(f"| pass | {peak_pass} |")
print(f"| governed (the larger of the two) | {peak_gov} |")
if peak_litellm:
    print(f"| litellm | {peak_litellm if peak_litellm != '0' else 'exited before the end'} |")
print()
print(f"cold start of the demo to /healthz: {cold} ms (median of 5); binary {binary} MB; image {image} MB (from {image_from or '-'})")
PY
