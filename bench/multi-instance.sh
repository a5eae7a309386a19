#!/usr/bin/env bash
# The multi-instance proof at a larger size: N gateway processes sharing one Redis and one
# upstream simulator, M concurrent requests (half streamed); the simulator's own counts must
# stay within the concurrency limit and the budget. Loopback only; stops by itself.
#
#   bench/multi-instance.sh [INSTANCES=4] [REQUESTS=2000]
set -euo pipefail
cd "$(dirname "$0")/.."
TOLLGATE_MI_INSTANCES="${1:-4}" TOLLGATE_MI_REQUESTS="${2:-2000}" \
  cargo test --release -q -p tollgate --test serve -- multi_instance --nocapture
