"""Random inputs of the fused-op tests: flat buffers (optionally unaligned views) and mixing weights."""

import os

import torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# tests/cuda_emulation/run.py: the CPU ops run the CUDA kernels' code, so the CPU cases take CUDA's dtypes.
CUDA_EMULATION = os.environ.get("DECENT_COMM_TEST_CUDA_EMULATION") == "1"
# Storage dtypes of x per device (the CUDA kernels are not built for float64).
DTYPES = {"cpu": [torch.float32, torch.bfloat16, torch.float16] + ([] if CUDA_EMULATION else [torch.float64]),
          "cuda": [torch.float32, torch.bfloat16, torch.float16]}


def flat(n, dtype, device, offset=0, gen=None, scale=1.0):
    """A random 1-D buffer of n elements; offset > 0 makes it a view whose data is not 16-byte aligned."""
    base = torch.randn(n + offset, generator=gen, dtype=torch.float64) * scale
    return base.to(device=device, dtype=dtype)[offset:]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def random_weights(k, g):
    """(self_weight, [w_1..w_k]): positive, summing to 1."""
    w = torch.rand(k + 1, generator=g, dtype=torch.float64) + 0.1
    w = (w / w.sum()).tolist()
    return w[0], w[1:]
