#!/usr/bin/env bash
# One-call GPU check: on a machine with an NVIDIA GPU, torch and triton already installed and no
# network, install this project over them, run the whole test suite on the GPU (the `gpu`-marked
# long-sequence tests included), then the quick benchmark suite, and print a short summary last.
#
#   bash bench/gpu_check.sh OUTDIR
#
# OUTDIR receives install.log, tests.log, bench.log and results/ (JSON, Markdown, PNG).
set -uo pipefail
out=${1:?usage: bash bench/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
python=${PYTHON:-python}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" 2>&1
"$python" -m pip install --no-deps --no-build-isolation -e . > "$out/install.log" 2>&1 \
  || { echo "install failed:"; tail -20 "$out/install.log"; exit 1; }

"$python" -m pytest -q -p no:cacheprovider --benchmark-disable tests bench > "$out/tests.log" 2>&1
tests_rc=$?
"$python" -m bench --quick --out "$out/results" > "$out/bench.log" 2>&1
bench_rc=$?

echo "== $(cat "$out/gpu.txt")"
echo "== tests (exit $tests_rc): $(tail -1 "$out/tests.log")"
grep -E "^(FAILED|ERROR)" "$out/tests.log" | head -20
echo "== quick benchmarks (exit $bench_rc): $(tail -1 "$out/bench.log")"
[ "$bench_rc" -eq 0 ] || tail -20 "$out/bench.log"
"$python" -m bench summary --out "$out/results"
exit $(( tests_rc != 0 || bench_rc != 0 ))
