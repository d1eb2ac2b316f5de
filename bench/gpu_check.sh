#!/usr/bin/env bash
# One call on a lent GPU machine (torch + nvcc + CuPy present, no network, the system python3): build the
# extension in place for the visible GPU only, run every CUDA test (the one-GPU NCCL transport tests must run:
# a skipped one fails the check, since then NCCL moved no byte), time the kernels and the NCCL transport, and
# print a compact table last. Budget: under 6 minutes on one H100 from a bare machine.
#   bash bench/gpu_check.sh             logs, JUnit XML and JSON under ${OUT:-bench/results}
#   DRY_RUN=1 bash bench/gpu_check.sh   no GPU needed: every step on the CPU, small, to check this script
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
PY="${PYTHON:-python3}"
DRY="${DRY_RUN:-0}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
SECONDS=0
step() { echo "== [${SECONDS} s] $*"; }

if [ "$DRY" = 1 ]; then
  export DECENT_COMM_CUDA=0
  DEVICE=cpu SIZES=65536 TEST_FILTER=cuda BENCH_ARGS="--repeats 2"
  echo "gpu_check: DRY RUN on the CPU (GPU steps skipped; the check is expected to FAIL)"
else
  if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    smi="$(command -v nvidia-smi > /dev/null && nvidia-smi -L 2>&1 | head -1 || echo 'nvidia-smi not found')"
    echo "gpu_check: no GPU visible to $PY (torch.cuda.is_available() is False; $smi). Nothing was built or" \
         "run: run this on the GPU machine (DRY_RUN=1 checks the script itself on a CPU)." >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  # The visible GPU's architecture only (e.g. 9.0 on H100/H200): one device pass per .cu file.
  TORCH_CUDA_ARCH_LIST="$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")"
  export TORCH_CUDA_ARCH_LIST DECENT_COMM_CUDA=1
  DEVICE=cuda SIZES=16M,64M TEST_FILTER="cuda or registered or info_says" BENCH_ARGS="--repeats 15 --inner 10"
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl',
      torch.cuda.nccl.version() if torch.cuda.is_available() else '-')"

step "build (DECENT_COMM_CUDA=$DECENT_COMM_CUDA, TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}, MAX_JOBS=$MAX_JOBS)"
if ! "$PY" setup.py -q build_ext --inplace > "$OUT_DIR/gpu_build.log" 2>&1; then
  tail -50 "$OUT_DIR/gpu_build.log"
  echo "gpu_check: FAIL (build)"
  exit 1
fi
"$PY" -c "import decent_comm, decent_comm.exchange as e; print('built: cuda kernels', decent_comm._native.built_with_cuda(),
      '| NCCL transport', e.nccl_available(), decent_comm._native.nccl_version())"

step "tests (skip reasons listed; a skipped one-GPU NCCL transport test counts as a failure)"
# -k matches module names too: all of test_ops_cuda_graph.py (graph capture, the device-scalar path), the cuda
# cases of the others (opcheck and torch.compile included), and the build report's CUDA dispatch-key check.
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_ops.py tests/test_ops_cuda_graph.py tests/test_ops_bad_input.py \
  tests/test_int8_codec.py tests/test_dequantizing_mix.py tests/test_optim_local.py tests/test_optim_amp.py \
  tests/test_build_info.py -k "$TEST_FILTER" \
  --junitxml "$OUT_DIR/gpu_tests_ops.xml" > "$OUT_DIR/gpu_tests_ops.log" 2>&1
tail -4 "$OUT_DIR/gpu_tests_ops.log"
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_exchange_nccl.py \
  --junitxml "$OUT_DIR/gpu_tests_nccl.xml" > "$OUT_DIR/gpu_tests_nccl.log" 2>&1
grep -E "^(FAILED|ERROR|SKIPPED)" "$OUT_DIR/gpu_tests_nccl.log" | cut -c1-220
tail -1 "$OUT_DIR/gpu_tests_nccl.log"

step "kernel benchmark ($SIZES elements; a failing competitor is left out, not fatal)"
# shellcheck disable=SC2086
"$PY" bench/mix_kernels.py --device "$DEVICE" --sizes "$SIZES" $BENCH_ARGS \
  --json "$OUT_DIR/mix_kernels_$DEVICE.json" > "$OUT_DIR/gpu_bench.log" 2>&1 || tail -20 "$OUT_DIR/gpu_bench.log"
grep -F "left out" "$OUT_DIR/gpu_bench.log"
# shellcheck disable=SC2086
"$PY" bench/int8_codec.py --device "$DEVICE" --sizes "$SIZES" --threads 1 $BENCH_ARGS \
  --json "$OUT_DIR/int8_codec_$DEVICE.json" > "$OUT_DIR/gpu_codec.log" 2>&1 || tail -20 "$OUT_DIR/gpu_codec.log"
grep -E "^\| (encode|decode)" "$OUT_DIR/gpu_codec.log"

step "NCCL transport benchmark (self-exchange)"
rm -f "$OUT_DIR/exchange_nccl_self.json"
if [ "$DRY" = 1 ]; then
  echo "skipped (dry run)"
else
  "$PY" bench/exchange.py --nccl-self --json "$OUT_DIR/exchange_nccl_self.json" > "$OUT_DIR/gpu_exchange.log" 2>&1 \
    || tail -20 "$OUT_DIR/gpu_exchange.log"
fi

step "summary"
"$PY" bench/gpu_check_summary.py --junit "$OUT_DIR/gpu_tests_ops.xml" "$OUT_DIR/gpu_tests_nccl.xml" \
  --mix "$OUT_DIR/mix_kernels_$DEVICE.json" --exchange "$OUT_DIR/exchange_nccl_self.json" --sizes "$SIZES"
status=$?
echo "gpu_check: GPU verdict (exit $status) after ${SECONDS} s"

# After the verdict, and bounded: CPU work that a slow host must not let push the GPU verdict past the call's limit.
step "the CPU loops on this host (issue #19: AVX-512 and AVX2 on another host CPU, e.g. an Intel Xeon)"
ISA="$("$PY" -c "from decent_comm import _native; print(_native.cpu_isa())")"
echo "decent_comm CPU loops: $ISA"
timeout 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cpu_dispatch.py > "$OUT_DIR/cpu_dispatch_tests.log" 2>&1
tail -1 "$OUT_DIR/cpu_dispatch_tests.log"
if [ "$ISA" = avx512 ] || [ "$DRY" = 1 ]; then
  for isa in "$ISA" avx2; do  # same run, same sizes: the AVX-512 loops against the AVX2 ones, both against torch
    DECENT_COMM_CPU_ISA=$isa timeout 90 "$PY" bench/mix_kernels.py --device cpu --quick --sizes "${SIZES%%,*}" \
      --threads 1 --only mix --repeats 3 --json "$OUT_DIR/mix_kernels_cpu_$isa.json" > "$OUT_DIR/cpu_bench_$isa.log" 2>&1
    echo "$isa:"; grep -E "^\| gossip_mix_" "$OUT_DIR/cpu_bench_$isa.log" | cut -c1-90
  done
fi

echo "gpu_check: ${SECONDS} s in all"
exit $status
