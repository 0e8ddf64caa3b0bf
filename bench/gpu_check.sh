#!/usr/bin/env bash
# One-call GPU check: on a machine with an NVIDIA GPU, torch and triton already installed and no
# network, install this project over them, run the whole test suite on the GPU (the `gpu`-marked
# long-sequence tests included), the quick benchmark suite, and the trainer (the README's main job
# and --find-max-seq-len), and print a short summary last.
#
#   bash bench/gpu_check.sh OUTDIR [STAGE...]     STAGE: tests, bench, train (default: all three)
#
# Stages can run in separate calls (a device call may be limited to 10 minutes); OUTDIR receives
# install.log, tests.log, bench.log, results/ (JSON, Markdown, PNG), train.log, train_main/
# (metrics.jsonl, training.png) and find_max/max_seq_len.json.
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUTDIR [tests|bench|train ...]}
shift
stages=${*:-tests bench train}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
"$python" -m pip install --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 \
  || { echo "install failed:"; tail -20 "$out/install.log"; exit 1; }

failed=0
echo "== $(cat "$out/gpu.txt")"
if [[ " $stages " == *" tests "* ]]; then
  "$python" -m pytest -q -p no:cacheprovider --benchmark-disable tests bench > "$out/tests.log" 2>&1
  rc=$?; failed=$(( failed || rc ))
  echo "== tests (exit $rc): $(tail -1 "$out/tests.log")"
  grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20
fi
if [[ " $stages " == *" bench "* ]]; then
  "$python" -m bench --quick --out "$out/results" > "$out/bench.log" 2>&1
  rc=$?; failed=$(( failed || rc ))
  echo "== quick benchmarks (exit $rc): $(tail -1 "$out/bench.log")"
  [ "$rc" -eq 0 ] || tail -20 "$out/bench.log"
  "$python" -m bench summary --out "$out/results"
fi
if [[ " $stages " == *" train "* ]]; then
  # The README's main job (short), then the longest trainable sequence per policy.
  { "$python" -m fused_remat.train --steps 100 --out "$out/train_main" \
      && "$python" -m fused_remat.train --find-max-seq-len --batch-size 1 --out "$out/find_max"; } > "$out/train.log" 2>&1
  rc=$?; failed=$(( failed || rc ))
  echo "== trainer (exit $rc):"
  grep -E "^\[#+\] (100|50)/100|^  (reference|fused_remat)|^done|error" "$out/train.log" | tail -12
fi
exit "$failed"
