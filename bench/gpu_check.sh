#!/usr/bin/env bash
# First contact with a GPU, in stages that each fit one 10-minute device call on one H100: on a
# machine with an NVIDIA GPU, torch and triton already installed and no network.
#
#   bash bench/gpu_check.sh [--dry-run] [--out DIR] [STAGE...]
#
#   install   install this project over the machine's torch and triton; versions, a kernel launch
#   block     first, what users feel: the block's forward+backward (cheap, none, full) against eager,
#             checkpoint and torch.compile (default and reduce-overhead), eager and as CUDA graphs,
#             with host_ms, at GPT-2-small N2048 and N8192 and Llama N4096
#   train     the README's main job (packed documents), 30 steps eager then 30 with --cuda-graphs
#             (tokens per second of each; metrics and plots kept, not the checkpoints)
#   tests     the gpu-marked tests (long sequences, bf16), then the kernels' own tests on the GPU
#   bench     attention (against SDPA's flash, cuDNN and efficient backends), norms, memory and the
#             loss (against eager, torch.compile and Liger-Kernel), quick mode
#   capacity  --find-max-seq-len: the longest sequence per policy beside the reference block
#
# Default: every stage, in that order; name some to run only those (one device call each). Each
# stage writes its log and gpu_check_<stage>.json (device, driver, torch, Triton, exit status, its
# summary) under DIR (default bench/results/<gpu>/, beside the benchmark suites' JSON); commit
# them, then `python -m bench results` puts them in docs/results.md. Each stage stops itself
# after STAGE_SECONDS (default 540) so that a call's 10 minutes leave time to fetch the results.
#
# A 15-minute lease (one machine start, about a minute, then one 10-minute call) fits install, block,
# train and tests, each under its own limit, in one call:
#   PYTHON=python3 STAGE_SECONDS=60 bash bench/gpu_check.sh install; \
#   PYTHON=python3 STAGE_SECONDS=200 bash bench/gpu_check.sh block; \
#   PYTHON=python3 STAGE_SECONDS=120 bash bench/gpu_check.sh train; \
#   PYTHON=python3 STAGE_SECONDS=150 bash bench/gpu_check.sh tests
# then copy bench/results/<gpu>/ into $OUT (as one tar: a call brings back at most 8 files).
#
# --dry-run runs every stage in miniature on a CPU, through Triton's interpreter or the reference
# backend, into DIR (required): what CI runs so that this script cannot rot. Its figures mean nothing.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python}
stage_seconds=${STAGE_SECONDS:-540}
dry=0
out=""
stages=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) dry=1 ;;
    --out) out=${2:?--out needs a folder}; shift ;;
    install|block|train|tests|bench|capacity) stages+=("$1") ;;
    *) echo "usage: bash bench/gpu_check.sh [--dry-run] [--out DIR] [install|block|train|tests|bench|capacity ...]" >&2; exit 2 ;;
  esac
  shift
done
[ ${#stages[@]} -gt 0 ] || stages=(install block train tests bench capacity)
if [ "$dry" -eq 1 ]; then
  [ -n "$out" ] || { echo "--dry-run needs --out DIR: its figures never go to bench/results/" >&2; exit 2; }
  export TRITON_INTERPRET=1
fi
if [ -z "$out" ]; then
  out=$("$python" -c "import torch; from bench.harness import device_folder; print(device_folder(torch.cuda.get_device_name()))") \
    || { echo "no GPU visible to torch: run with --dry-run --out DIR on a CPU" >&2; exit 2; }
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)

# Runs one stage (a function below, in a child shell so that timeout can stop it) under the time
# limit, then records it: its log and gpu_check_<stage>.json.
run_stage() {
  local stage=$1
  local log="$out/gpu_check_$stage.log"
  local started=$SECONDS
  timeout "$stage_seconds" bash -c "$stage" > "$log" 2>&1
  local rc=$?
  local record=(--exit "$rc" --seconds $((SECONDS - started)) --log "$log" --out "$out")
  [ "$dry" -eq 0 ] || record+=(--dry-run)
  "$python" -m bench gpu_stage "$stage" "${record[@]}"
  return "$rc"
}

install() {
  if [ "$dry" -eq 0 ]; then
    "$python" -m pip install --no-deps --no-build-isolation -e . || return 1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  fi
  # one real launch of each kind of kernel, checked against the reference
  "$python" -c "
import torch, fused_remat
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = torch.bfloat16 if device == 'cuda' else torch.float32
block = fused_remat.TransformerBlock(128, 4, rope_theta=1e4, device=device, dtype=dtype)
x = torch.randn(2, 64, 128, device=device, dtype=dtype, requires_grad=True)
block(x).float().square().mean().backward()
reference = fused_remat.reference.TransformerBlock(128, 4, rope_theta=1e4, device=device, dtype=dtype)
reference.load_state_dict(block.state_dict())
error = (block(x) - reference(x)).abs().max().item()
print(f'one block step on {device}: max difference from the reference {error:.3g}')
assert error < 0.1 and x.grad.isfinite().all()
"
}

tests() {
  # Without CUDA the gpu-marked tests skip, and CI runs the kernel files anyway: a dry run collects.
  # On the GPU machine, 8 pytest workers share the card (the tests are sized for that) so that both
  # runs fit the stage; each failure is listed (-rfE) rather than the run stopped at the first.
  local options=(-q -p no:cacheprovider --benchmark-disable)
  if [ "$dry" -eq 1 ]; then options+=(--collect-only); else options+=(-n 8 --timeout 150 -rfE --tb=short); fi
  "$python" -m pytest "${options[@]}" -m gpu tests bench
  local rc=$?
  "$python" -m pytest "${options[@]}" tests/test_attention.py tests/test_norms.py tests/test_activations.py \
    tests/test_rope.py tests/test_block.py tests/test_remat_points.py
  return $(( rc || $? ))
}

block() {
  if [ "$dry" -eq 1 ]; then
    # the suite's own smoke run is a CI test (bench/bench_block.py): here the stage's path
    "$python" -m bench --smoke --quick --out "$out/block" block
  else
    "$python" -m bench --quick --out "$out" block
  fi
}

bench() {
  if [ "$dry" -eq 1 ]; then
    # the suites' own smoke runs are CI tests (tests/test_bench_cli.py): here the stage's path, on the quickest
    "$python" -m bench --smoke --quick --out "$out/bench" norms && "$python" -m bench summary --out "$out/bench"
  else
    "$python" -m bench --quick --out "$out" attention norms memory loss && "$python" -m bench summary --out "$out"
  fi
}

train() {
  # The same job twice: a graph holds the documents in one padded form (training/graphs.py).
  if [ "$dry" -eq 1 ]; then
    "$python" -m fused_remat.train --backend reference --steps 2 --eval-interval 2 --seq-len 32 --batch-size 2 \
      --eval-batches 2 --out "$out/train_main"
    return
  fi
  local name run_dir  # each run's checkpoint (GBs) stays out of the results: its metrics and plot are copied over
  for name in train_main train_main_graphed; do
    run_dir=$(mktemp -d)
    local graphs=()
    [ "$name" = train_main ] || graphs=(--cuda-graphs)
    "$python" -m fused_remat.train --steps 30 --eval-interval 30 "${graphs[@]}" \
      --out "$run_dir" || return 1
    mkdir -p "$out/$name" && cp "$run_dir/metrics.jsonl" "$run_dir"/*.png "$out/$name/"
    "$python" -c "import json, sys, statistics as s; r = [json.loads(l) for l in open(sys.argv[1])][5:]; \
print(sys.argv[2], 'tokens/s (median after 5 steps):', round(s.median(x['tokens_per_s'] for x in r)))" \
      "$run_dir/metrics.jsonl" "$name"
  done
}

capacity() {
  if [ "$dry" -eq 1 ]; then
    "$python" -m fused_remat.train --find-max-seq-len --preset tiny --batch-size 1 --memory-limit 1MiB \
      --out "$out/find_max"
  else
    "$python" -m fused_remat.train --find-max-seq-len --batch-size 1 --out "$out/find_max"
  fi
}

export python out dry
export -f install block train tests bench capacity
failed=0
for stage in "${stages[@]}"; do
  run_stage "$stage"
  rc=$?
  failed=$(( failed || rc ))
  if [ "$stage" = install ] && [ "$rc" -ne 0 ]; then
    echo "install failed: the other stages would test what is not installed" >&2
    exit 1
  fi
done
exit "$failed"
