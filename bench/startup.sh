#!/usr/bin/env bash
# What a binary costs before it serves: its size, the demo's cold start to /healthz (five runs),
# its RSS once the vocabularies are unpacked (3 s after start), and `tollgate count`'s time and
# peak RSS for a model of each vocabulary and one counted by bytes (seven runs each). Loopback
# only; each process is stopped when measured.
#
#   bench/startup.sh [BINARY...]   (default: target/release/tollgate, built first)
#
# Give two binaries, e.g. `scripts/release`'s dist/tollgate and an earlier build's, to compare
# them in one run.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -eq 0 ]; then
  cargo build --release -q -p tollgate
  set -- target/release/tollgate
fi
python3 - "$@" <<'PY'
import json, os, socket, statistics, subprocess, sys, tempfile, time

request = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
json.dump({"model": "gpt-4o", "messages": [{"role": "user", "content": "hello there " * 50}]}, request)
request.close()

def cold(binary):
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    t0 = time.perf_counter()
    p = subprocess.Popen([binary, "serve", "--demo", "--listen", f"127.0.0.1:{port}"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
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
        ms = (time.perf_counter() - t0) * 1000
        time.sleep(3)
        rss = next(l.split()[1] for l in open(f"/proc/{p.pid}/status") if l.startswith("VmRSS"))
        return ms, int(rss) // 1024
    finally:
        p.terminate(); p.wait()

def count(binary, model):
    t0 = time.perf_counter()
    p = subprocess.Popen([binary, "count", "--model", model, "--request", request.name],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(p.pid, 0)
    ms = (time.perf_counter() - t0) * 1000
    if status != 0:
        sys.exit(f"tollgate count --model {model} failed")
    p.returncode = 0
    return ms, usage.ru_maxrss // 1024

for binary in sys.argv[1:]:
    print(f"{binary}: {os.path.getsize(binary) / 1e6:.1f} MB")
    runs = [cold(binary) for _ in range(5)]
    print(f"  cold start to /healthz: {statistics.median(r[0] for r in runs):.0f} ms (median of 5); "
          f"RSS 3 s after start: {statistics.median(r[1] for r in runs):.0f} MB")
    for model in ["claude-sonnet-4-5", "gpt-4", "gpt-4o"]:
        runs = [count(binary, model) for _ in range(7)]
        print(f"  tollgate count --model {model}: {statistics.median(r[0] for r in runs):.0f} ms, "
              f"peak RSS {statistics.median(r[1] for r in runs):.0f} MB (medians of 7)")
PY
