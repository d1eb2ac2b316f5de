# decent_comm developer entry points.
#   make demo   install, build, run the main demo
#   make test   install, build, run the test suite (and the kernel tests against the CUDA kernels emulated on the CPU)
# Everything lives in .venv (created if missing). TORCH_SPEC picks the torch to install; torch >= 2.11
# builds the extension (make test-min-torch: the torch-sensitive tests under 2.11, in a venv of their own).

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.14.1
STAMP := $(VENV)/.decent_comm-deps
MAX_JOBS ?= 2
PYTEST_ARGS ?=

export OMP_NUM_THREADS ?= 1
export MAX_JOBS

.PHONY: all venv importable build test test-cuda-emulation check-torch-headers test-min-torch demo bench cmake-build clean

all: build

$(STAMP): requirements-dev.txt Makefile
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -r requirements-dev.txt
	touch $@

venv: $(STAMP)

# In-place build; ninja makes it incremental.
build: $(STAMP) importable
	$(VPY) setup.py -q build_ext --inplace
	@$(VPY) -m decent_comm info | grep '^kernels'

# A .pth file in the venv's site-packages names this checkout, so the venv's python imports decent_comm (built in
# place) and the decent_train harness from any directory: bench scripts, torchrun workers, `sudo .venv/bin/python`
# (no sys.path edits in the scripts; nothing is installed or copied, edits take effect at once).
importable: $(STAMP)
	$(VPY) -c 'import os, sys, sysconfig; open(os.path.join(sysconfig.get_paths()["purelib"], "decent_comm_checkout.pth"), "w").write(sys.argv[1] + "\n")' "$(CURDIR)"

# The suite, then the CUDA kernels' own code run on the CPU against the kernel tests (tests/cuda_emulation: about
# 3 minutes on 2 cores; no GPU or nvcc needed).
test: build
	$(VPY) -m pytest -q tests $(PYTEST_ARGS)
	$(VPY) tests/cuda_emulation/run.py

test-cuda-emulation: $(STAMP)
	$(VPY) tests/cuda_emulation/run.py

# Every host C++ file compiled (syntax only, CUDA and NCCL parts included) against the GPU machine's torch headers
# (TORCH_HEADERS, default 2.11.0; the wheel is fetched once from the package registry): an API newer than that
# torch fails here instead of in bench/gpu_check.sh on the lent GPU.
TORCH_HEADERS ?= 2.11.0
check-torch-headers: $(STAMP)
	$(VPY) build_tools/check_torch_headers.py --torch $(TORCH_HEADERS) --jobs $(MAX_JOBS)

# The tests most sensitive to torch's internals (Dynamo, torch.optim's hooks, DCP, AMP, the custom ops) under the
# oldest torch pyproject allows (TORCH_MIN, the GPU machine's): a venv of its own in build/min-torch, and the extension
# built in a copy of the sources there, so this checkout's build and .venv are untouched (build_tools/test_min_torch.py;
# it shares the torch wheel with check-torch-headers). About 6 minutes on 2 cores from scratch (venv 1, build 3,
# tests 2), 2.5 on a rerun; the venv takes about 5 GB (torch's CUDA libraries).
TORCH_MIN ?= 2.11.0
test-min-torch: $(STAMP)
	$(VPY) build_tools/test_min_torch.py --torch $(TORCH_MIN) --jobs $(MAX_JOBS)

# 4 local CPU ranks: all-reduce vs DAdamW (one-peer-exp) vs AccumAdamW (aer, 2 emulated nodes); table + plot.
demo: build
	$(VPY) bench/demo.py

bench: build
	$(VPY) bench/mix_kernels.py
	$(VPY) bench/step.py
	$(VPY) bench/exchange.py

# The CMake build of the same extension (CPU kernels; add -DDECENT_COMM_CUDA=ON for CUDA).
# A CUDA build of torch needs its toolkit found even for a CPU-only extension (Caffe2Config checks it),
# and an arch list, or it try-runs a GPU probe.
cmake-build: $(STAMP) importable
	TORCH_CUDA_ARCH_LIST="$${TORCH_CUDA_ARCH_LIST:-9.0}" cmake -S . -B build/cmake -G Ninja -DCMAKE_MAKE_PROGRAM=$(abspath $(VENV))/bin/ninja \
	  -DPython_EXECUTABLE=$(abspath $(VPY)) -DDECENT_COMM_CUDA=OFF \
	  -DCUDA_TOOLKIT_ROOT_DIR="$$($(PYTHON) build_tools/cuda_home.py)"
	cmake --build build/cmake -j $(MAX_JOBS)

clean:
	rm -rf build decent_comm/_C*.so
