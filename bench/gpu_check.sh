#!/usr/bin/env bash
# One call on a lent GPU machine (torch + nvcc + CuPy present, no network): build the extension in place
# for the visible GPU, run every CUDA test and the kernel benchmark, and print a short table last.
#   bash bench/gpu_check.sh            (logs and JSON under ${OUT:-bench/results})
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-16}"
# A bare machine's python (no .venv, so no .pth from `make build`) imports the in-place build from the checkout.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name())"

status=0
echo "== build"
if ! DECENT_COMM_CUDA=1 "$PY" setup.py -q build_ext --inplace > "$OUT_DIR/gpu_build.log" 2>&1; then
  tail -50 "$OUT_DIR/gpu_build.log"; echo "BUILD FAILED"; exit 1
fi
echo "== CUDA tests"
"$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py tests/test_optim_local.py tests/test_exchange.py \
  -k "cuda or nccl or registered or compile or opcheck" 2>&1 | tee "$OUT_DIR/gpu_tests.log" | tail -25
test_rc=${PIPESTATUS[0]}
[ "$test_rc" -ne 0 ] && status=1
echo "== kernel benchmark"
"$PY" bench/mix_kernels.py --device cuda --json "$OUT_DIR/mix_kernels_cuda.json" > "$OUT_DIR/gpu_bench.log" 2>&1 || status=1
echo
echo "== summary (GB/s of the minimum bytes; roofline = same-shape in-place torch kernel (add_/addcmul_, else best of those and copy_); speedup = baseline / ours)"
grep -E "^\| (op|gossip|mix_adam)" "$OUT_DIR/gpu_bench.log" | head -40
echo "tests: $(tail -1 "$OUT_DIR/gpu_tests.log")"
exit $status
