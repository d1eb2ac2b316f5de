"""Which kernels a build holds: setup.py's choice (build_tools/kernel_choice.py) and `python -m decent_comm info`."""
import contextlib
import io

import pytest
import torch

from build_tools.kernel_choice import want_cuda
from decent_comm import ops
from decent_comm.cli import main


def never_asked():
    raise AssertionError("asked whether a GPU is visible when the answer did not matter")


@pytest.mark.parametrize("env, have, gpu, expect, why", [
    ({}, True, lambda: False, False, "no GPU visible"),       # nvcc on a CPU machine: CPU kernels only (fast)
    ({}, True, lambda: True, True, "a GPU is visible"),
    ({}, False, never_asked, False, "no CUDA toolchain"),
    ({"TORCH_CUDA_ARCH_LIST": "9.0"}, True, never_asked, True, "TORCH_CUDA_ARCH_LIST=9.0"),  # how CI compiles CUDA
    ({"TORCH_CUDA_ARCH_LIST": "9.0"}, False, never_asked, False, "no CUDA toolchain"),
    ({"DECENT_COMM_CUDA": "0", "TORCH_CUDA_ARCH_LIST": "9.0"}, True, never_asked, False, "DECENT_COMM_CUDA=0"),
    ({"DECENT_COMM_CUDA": "1"}, True, never_asked, True, "DECENT_COMM_CUDA=1"),
])
def test_kernel_choice(env, have, gpu, expect, why):
    built, reason = want_cuda(env, have, "nvcc=/x", gpu)
    assert built is expect and why in reason


def test_kernel_choice_refuses_what_it_cannot_do():
    with pytest.raises(RuntimeError, match="DECENT_COMM_CUDA=1 but no usable CUDA toolchain: nvcc=None"):
        want_cuda({"DECENT_COMM_CUDA": "1"}, False, "nvcc=None", never_asked)
    with pytest.raises(ValueError, match="DECENT_COMM_CUDA='yes'"):
        want_cuda({"DECENT_COMM_CUDA": "yes"}, True, "", never_asked)


def test_info_says_which_kernels_were_built():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["info"]) == 0
    lines = dict(line.split(": ", 1) for line in out.getvalue().splitlines() if not line.startswith("note"))
    assert lines["kernels"] == ("CPU and CUDA" if ops.has_cuda_kernels() else "CPU only")
    assert lines["torch"] == torch.__version__
    assert lines["cuda_devices_visible"] == str(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if not ops.has_cuda_kernels():  # what builds them, as `info --help` promises
        assert "DECENT_COMM_CUDA=1" in out.getvalue().splitlines()[-1], out.getvalue()
    # The kernels it names are the ones that run: a CUDA build registers a CUDA kernel for the op.
    assert torch._C._dispatch_has_kernel_for_dispatch_key("decent_comm::gossip_mix_", "CUDA") == ops.has_cuda_kernels()
