#!/usr/bin/env bash
# One call on a lent GPU machine (torch + nvcc + CuPy present, no network, the system python3): build the
# extension in place for the visible GPU only, run every CUDA test (the one-GPU NCCL transport tests must run:
# a skipped one fails the check, since then NCCL moved no byte), train a tiny LM on the GPU end to end, time the
# kernels and the NCCL transport, and print a compact table last. Budget: under 6 minutes on one H100 from a bare
# machine (3.5 minutes on an H200 without the LM step).
#   bash bench/gpu_check.sh             the logs, JUnit XML and JSON packed into ${OUT:-bench/results}/gpu_check.tar.gz
#   DRY_RUN=1 bash bench/gpu_check.sh   no GPU needed: every step on the CPU, small, to check this script
# Every step runs under a timeout that leaves the summary its time before GPU_CHECK_SECONDS (default 450): a hung
# test or benchmark costs its step, not the verdict. A step cut at its bound gets SIGINT, which pytest handles by
# writing the JUnit XML of the tests it finished (SIGTERM wrote none: the step's every result was lost) and the
# benchmarks by stopping with KeyboardInterrupt; SIGKILL follows 10 s later. The summary counts a cut test step as
# a failure (the tests after the cut did not run). The device tool returns at most 8 files from $OUT, so the
# step outputs are written to a scratch folder and packed into one archive on exit, whatever ended the script.
# The run call's timeout_s must be at least GPU_CHECK_SECONDS + 30 s (480 by default): the CPU steps after the
# verdict may run up to GPU_CHECK_SECONDS, a cut step's SIGKILL comes up to 10 s after its bound, and the python
# start-ups and the archive take a few seconds more; a run killed by the tool packs no archive.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR="${OUT:-bench/results}"
mkdir -p "$OUT_DIR"
W="$(mktemp -d)"
trap 'tar -czf "$OUT_DIR/gpu_check.tar.gz" -C "$W" . && rm -rf "$W"' EXIT
PY="${PYTHON:-python3}"
DRY="${DRY_RUN:-0}"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
SECONDS=0
DEADLINE="${GPU_CHECK_SECONDS:-450}"
SUMMARY_RESERVE=20
step() { echo "== [${SECONDS} s] $*"; }
# bounded BUDGET CMD...: CMD under a timeout of BUDGET seconds, or of what is left before the summary's reserve.
# At the bound, SIGINT (to CMD's whole process group: spawned ranks, ninja and nvcc too); SIGKILL 10 s later if it
# is still there (a wait in C code that returns to Python only then). A cut command's --junitxml file, if it has
# one, is listed in $W/gpu_check_cut.txt: the summary fails the verdict for it (its XML holds the finished tests).
bounded() {
  local budget=$1 left=$((DEADLINE - SUMMARY_RESERVE - SECONDS))
  shift
  if [ "$left" -lt 5 ]; then
    echo "gpu_check: out of time (${SECONDS} s of ${DEADLINE}): skipped $*"
    return 124
  fi
  timeout -s INT -k 10 "$((budget < left ? budget : left))" "$@"
  local rc=$? prev=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then  # 137: still running 10 s after the SIGINT, killed
    echo "gpu_check: timed out (rc $rc): $*"
    for arg in "$@"; do
      [ "$prev" = --junitxml ] && echo "$arg" >> "$W/gpu_check_cut.txt"
      prev=$arg
    done
  fi
  return "$rc"
}

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
if ! bounded 300 "$PY" setup.py -q build_ext --inplace > "$W/gpu_build.log" 2>&1; then
  grep -E "error|Error" "$W/gpu_build.log" | head -20
  tail -30 "$W/gpu_build.log"
  echo "gpu_check: FAIL (build)"
  exit 1
fi
"$PY" -c "import decent_comm, decent_comm.exchange as e; print('built: cuda kernels', decent_comm._native.built_with_cuda(),
      '| NCCL transport', e.nccl_available(), decent_comm._native.nccl_version())"
# Which C++ runtime the extension uses: a compiler that links libstdc++ statically puts a second copy in _C.so
# (setup.py keeps it private; a copy whose symbols leaked segfaulted the first C++ error message with an integer).
stdcxx="$(ldd decent_comm/_C*.so | grep -oE 'libstdc\+\+[^ ]* => [^ ]*' || echo 'no libstdc++.so (static)')"
locale_symbols="$(nm -D --defined-only decent_comm/_C*.so | grep -c '_ZNSt6locale')"
echo "C++ runtime: $stdcxx, $locale_symbols std::locale symbols exported"

step "tests (failures and skip reasons listed; a skipped one-GPU NCCL transport test counts as a failure)"
# -k matches module names too: all of test_ops_cuda_graph.py (graph capture, the device-scalar path), the cuda
# cases of the others (opcheck and torch.compile included), and the build report's CUDA dispatch-key check.
# -rfEs: pytest's summary names failures and errors as well as skips (-rs alone would drop the FAILED lines).
bounded 150 "$PY" -m pytest -q -rfEs -p no:cacheprovider --timeout 120 tests/test_ops.py tests/test_ops_cuda_graph.py \
  tests/test_ops_bad_input.py tests/test_int8_codec.py tests/test_dequantizing_mix.py tests/test_optim_local.py \
  tests/test_optim_amp.py tests/test_build_info.py -k "$TEST_FILTER" \
  --junitxml "$W/gpu_tests_ops.xml" > "$W/gpu_tests_ops.log" 2>&1
tail -4 "$W/gpu_tests_ops.log"
# --timeout above the spawned groups' own limit (SUITE_S in the file), which the first test of a group waits for.
bounded 200 "$PY" -m pytest -q -rfEs -p no:cacheprovider --timeout 110 tests/test_exchange_nccl.py \
  --junitxml "$W/gpu_tests_nccl.xml" > "$W/gpu_tests_nccl.log" 2>&1
grep -E "^(FAILED|ERROR|SKIPPED)" "$W/gpu_tests_nccl.log" | cut -c1-220
tail -1 "$W/gpu_tests_nccl.log"

step "kernel benchmark ($SIZES elements; a failing competitor is left out, not fatal)"
# shellcheck disable=SC2086
bounded 60 "$PY" bench/mix_kernels.py --device "$DEVICE" --sizes "$SIZES" $BENCH_ARGS \
  --json "$W/mix_kernels_$DEVICE.json" > "$W/gpu_bench.log" 2>&1 || tail -20 "$W/gpu_bench.log"
grep -F "left out" "$W/gpu_bench.log"
# shellcheck disable=SC2086
bounded 45 "$PY" bench/int8_codec.py --device "$DEVICE" --sizes "$SIZES" --threads 1 $BENCH_ARGS \
  --json "$W/int8_codec_$DEVICE.json" > "$W/gpu_codec.log" 2>&1 || tail -20 "$W/gpu_codec.log"
grep -E "^\| (encode|decode)" "$W/gpu_codec.log"

step "NCCL transport benchmark (self-exchange)"
if [ "$DRY" = 1 ]; then
  echo "skipped (dry run)"
else
  bounded 45 "$PY" bench/exchange.py --nccl-self --json "$W/exchange_nccl_self.json" > "$W/gpu_exchange.log" 2>&1 \
    || tail -20 "$W/gpu_exchange.log"
fi

# After the benchmarks: a slow first run of it must not cost their numbers.
step "end to end: train_lm under torchrun on one GPU (NCCL group), against the same job on the CPU, and resumed"
bounded 200 "$PY" -m pytest -q -rfEs -p no:cacheprovider --timeout 170 tests/test_train_cuda.py \
  --junitxml "$W/gpu_tests_train.xml" > "$W/gpu_tests_train.log" 2>&1
grep -E "^(FAILED|ERROR)" "$W/gpu_tests_train.log" | cut -c1-220
tail -1 "$W/gpu_tests_train.log"

step "summary"
"$PY" bench/gpu_check_summary.py --junit "$W/gpu_tests_ops.xml" "$W/gpu_tests_nccl.xml" "$W/gpu_tests_train.xml" \
  --cut "$W/gpu_check_cut.txt" \
  --mix "$W/mix_kernels_$DEVICE.json" --exchange "$W/exchange_nccl_self.json" --sizes "$SIZES" \
  | tee "$W/gpu_check_summary.txt"
status=$?
echo "gpu_check: GPU verdict (exit $status) after ${SECONDS} s"

# After the verdict, and bounded: CPU work that a slow host must not let push the GPU verdict past the call's limit.
step "the CPU loops on this host (issue #19: AVX-512 and AVX2 on another host CPU, e.g. an Intel Xeon)"
ISA="$("$PY" -c "from decent_comm import _native; print(_native.cpu_isa())")"
echo "decent_comm CPU loops: $ISA"
SUMMARY_RESERVE=0
bounded 120 "$PY" -m pytest -q -p no:cacheprovider tests/test_cpu_dispatch.py > "$W/cpu_dispatch_tests.log" 2>&1
tail -1 "$W/cpu_dispatch_tests.log"
if [ "$ISA" = avx512 ] || [ "$DRY" = 1 ]; then
  for isa in "$ISA" avx2; do  # same run, same sizes: the AVX-512 loops against the AVX2 ones, both against torch
    DECENT_COMM_CPU_ISA=$isa bounded 90 "$PY" bench/mix_kernels.py --device cpu --quick --sizes "${SIZES%%,*}" \
      --threads 1 --only mix --repeats 3 --json "$W/mix_kernels_cpu_$isa.json" > "$W/cpu_bench_$isa.log" 2>&1
    echo "$isa:"; grep -E "^\| gossip_mix_" "$W/cpu_bench_$isa.log" | cut -c1-90
  done
fi

echo "gpu_check: ${SECONDS} s in all (outputs: $OUT_DIR/gpu_check.tar.gz)"
exit $status
