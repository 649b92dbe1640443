#!/usr/bin/env bash
# The content classifier's native cost per call (docs/filter-benchmark.md, content classifier):
# callgrind's instructions in classify_body over N calls, the wall time of the same N calls
# natively (5 runs: best and worst), and instructions per cycle at the clock `classify_bench clock`
# measures. Usage: bash filter/bench/content_instructions.sh [KB] [MAX_TEXT]   (defaults 2 4096)
set -euo pipefail
cd "$(dirname "$0")/.."
KB="${1:-2}"; MAX_TEXT="${2:-4096}"; N=100; RUNS_N=50000
cargo build --release --quiet --example classify_bench
B=target/release/examples/classify_bench
GHZ="$($B clock | awk '{print $2}')"
echo "clock ${GHZ} GHz; ${KB} KB of text, read ${MAX_TEXT} bytes"
for c in "3 4" "3 3" "0 0"; do
  instr="$(valgrind --tool=callgrind --toggle-collect='*classify_body*' --callgrind-out-file=/dev/null \
            $B content-count $c "$MAX_TEXT" "$KB" "$N" 2>&1 | awk '/Collected/ {print $4}')"
  times="$(for r in 1 2 3 4 5; do $B content-count $c "$MAX_TEXT" "$KB" "$RUNS_N" | awk '{print $(NF-1)}'; done)"
  python3 - "$c" "$instr" "$N" "$GHZ" $times <<'PY'
import sys
chars, instr, n, ghz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
us = sorted(map(float, sys.argv[5:]))
per = instr / (n + 1)  # the N calls and content_case's check that classify_body = classify_text
print(f"chars {chars:4}: {per/1e3:7.1f} k instr/call, {us[0]:6.2f} us best ({us[len(us)//2]:.2f} median, {us[-1]:.2f} worst), "
      f"IPC {per / (us[0] * 1e3 * ghz):.2f} at the best ({per / (us[-1] * 1e3 * ghz):.2f} at the worst)")
PY
done
