# Sourced by the gateway benchmarks (load.sh, rate.sh, gateway-cost.sh, redis-cost.sh, context.sh,
# ledger-rows.sh) after reading their arguments: builds the release binaries, sets $BIN (where
# they are) and $tmp (a scratch directory), and stops on exit what the benchmark started
# (cleanup); then loopback ports, the upstream simulator, and gateway configurations for the
# setups compared.
cargo build --release -q -p tollgate -p tollgate-sim
BIN=target/release
tmp=$(mktemp -d)
pids=()

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
# Waits up to $2 tenths of a second (default 100) for a loopback port to accept connections.
wait_port() {
  for _ in $(seq "${2:-100}"); do (echo > /dev/tcp/127.0.0.1/$1) 2>/dev/null && return 0; sleep 0.1; done
  echo "port $1 never opened"; exit 1
}

# Starts the upstream simulator (no latency, 16 output tokens) and a redis-server with no
# persistence, on free ports: sets SIM, REDIS and REDIS_PID, and adds both processes to the
# caller's `pids` array, which its clean-up stops.
start_upstreams() {
  SIM=$(free_port)
  "$BIN/tollgate-sim" --listen "127.0.0.1:$SIM" --latency-ms 0 --token-delay-ms 0 --output-tokens 16 >/dev/null &
  pids+=($!)
  wait_port "$SIM"
  REDIS=$(free_port)
  redis-server --port "$REDIS" --bind 127.0.0.1 --save "" --appendonly no --loglevel warning >/dev/null &
  REDIS_PID=$!
  pids+=($!)
  wait_port "$REDIS"
}

# The callers' EXIT trap: stops what the benchmark started (the `pids` array, the gateways'
# pids, which start inside $(...) subshells and so go to a file, and a PostgreSQL of
# start_postgres) and removes $tmp.
cleanup() {
  for p in "${pids[@]}" $(cat "$tmp/gateway-pids" 2>/dev/null); do kill "$p" 2>/dev/null || true; done
  [ -n "${PG_STOP:-}" ] && $PG_STOP >/dev/null 2>&1 || true
  rm -rf "$tmp"
}

# The upstreams and the four gateways every throughput benchmark compares: sets PASS, MEM,
# RED, SLI and TARGETS (simulator direct, pass-through, six controls on memory, on Redis one
# call per admission, and on Redis with leased slices under their own prefix).
start_targets() {
  start_upstreams
  PASS=$(gateway pass "" "")
  MEM=$(gateway memory "" "$ALL_SIX")
  RED=$(gateway redis "$(redis_store_toml "$REDIS")" "$ALL_SIX")
  SLI=$(gateway redis-sliced "$(sliced_store_toml "$REDIS")" "$ALL_SIX")
  TARGETS=("direct $SIM" "pass $PASS" "memory $MEM" "redis $RED" "redis-sliced $SLI")
}

# Starts a PostgreSQL on a free port in $tmp/pg (as `postgres` when run as root, which
# PostgreSQL refuses to run as), with its default durability: sets PG_URL and PG_STOP.
start_postgres() {
  local port; port=$(free_port)
  local dir="$tmp/pg" as=()
  mkdir -p "$dir"
  if [ "$(id -u)" = 0 ]; then chmod o+x "$tmp"; chown postgres "$dir"; as=(runuser -u postgres --); fi
  "${as[@]}" initdb -D "$dir/data" -A trust -U tollgate >/dev/null
  "${as[@]}" pg_ctl -D "$dir/data" -o "-p $port -k $dir -c listen_addresses=127.0.0.1" -l "$dir/log" -w start >/dev/null
  PG_URL="postgres://tollgate@127.0.0.1:$port/postgres"
  PG_PID=$(head -1 "$dir/data/postmaster.pid")
  PG_STOP="${as[*]} pg_ctl -D $dir/data -m immediate -w stop"
}

# All six controls on one per-key scope, with limits the benchmark never reaches: every
# control is checked and counted on every request, none refuses.
ALL_SIX='
[[policy.scopes]]
name = "per-key"
key = "key"
requests = { limit = 100000000, window = "1m" }
input_tokens = 100000
output_tokens = { max = 4096, mode = "clamp" }
total_tokens = 200000
concurrency = { limit = 100000, lease_ttl = "1m" }
budget = { tokens = 1000000000000, period = "day" }
'

# The same, and a rule on the agent operation the request names (bench/post-operation.lua
# sends one): its rounds, budget and concurrency.
WITH_OPERATION="$ALL_SIX"'
[[policy.scopes]]
name = "per-operation"
key = "operation"
requests = { limit = 100000000, window = "1h" }
concurrency = { limit = 100000, lease_ttl = "1m" }
budget = { tokens = 1000000000000, period = "day" }
'

# The six controls with alerts configured (thresholds on the budget, a webhook), and a shadow
# rule trying a stricter rate and budget per key: what an operator runs while changing a
# policy. The limits are never reached, so no alert is sent: the cost measured is that of
# checking for them and of the shadow admission on every request.
WITH_SHADOW=$(printf '%s\n' "$ALL_SIX" | sed 's/period = "day" }/period = "day", alert_at = [50, 80, 95] }/')'
[[policy.scopes]]
name = "per-key-trial"
key = "key"
mode = "shadow"
requests = { limit = 50000000, window = "1m" }
budget = { tokens = 500000000000, period = "day", alert_at = [80] }
[alerts]
[[alerts.webhooks]]
url = "http://127.0.0.1:9/unused"
'

# gateway_config NAME PORT SIM_PORT STORE_TOML POLICY_TOML: writes $tmp/NAME.toml ($SERVER_EXTRA,
# when set, goes into its [server] section).
gateway_config() {
  local hash; hash=$("$BIN/tollgate" hash-key sk-bench)
  cat > "$tmp/$1.toml" <<TOML
$5
$4
[server]
listen = "127.0.0.1:$2"
max_connections = 4096
max_connections_per_ip = 4096
${SERVER_EXTRA:-}
[[upstreams]]
name = "sim"
base_url = "http://127.0.0.1:$3"
models = ["gpt-4o"]
[[keys]]
hash = "$hash"
tenant = "bench"
TOML
}

# gateway NAME STORE_TOML POLICY_TOML: starts a gateway in front of $SIM on a free port and prints
# the port; its pid goes to $tmp/pid-NAME and $tmp/gateway-pids (it starts inside a $(...)
# subshell, so the caller's clean-up reads the file, not an array).
gateway() {
  local port; port=$(free_port)
  gateway_config "$1" "$port" "$SIM" "$2" "$3"
  init_store "$1" "$2"
  "$BIN/tollgate" serve --config "$tmp/$1.toml" >/dev/null 2>&1 &
  echo $! >> "$tmp/gateway-pids"
  echo $! > "$tmp/pid-$1"
  wait_port "$port"
  echo "$port"
}

# init_store NAME STORE_TOML: a fresh Redis is initialised by an operator before the first start
# (an empty store is never taken for a new one on its own), here from the gateway's file.
# (A build from before that command starts on an empty Redis by itself.)
init_store() {
  "$BIN/tollgate" admin init-store --help >/dev/null 2>&1 || return 0
  case "$2" in *redis://*) "$BIN/tollgate" admin init-store --config "$tmp/$1.toml" >/dev/null ;; esac
}

# redis_store_toml PORT: the [store] section of the Redis setup, one call per request (slices,
# on by default, turned off).
redis_store_toml() {
  printf '[store]\nurl = "redis://127.0.0.1:%s/"\ncall_timeout = "2s"\n[store.slices]\nenabled = false\n' "$1"
}

# sliced_store_toml PORT [PREFIX]: the same Redis with leased slices (default settings), its own
# prefix (`sliced` unless given).
sliced_store_toml() {
  printf '[store]\nurl = "redis://127.0.0.1:%s/"\ncall_timeout = "2s"\nprefix = "%s"\n[store.slices]\n' "$1" "${2:-sliced}"
}

trap cleanup EXIT
