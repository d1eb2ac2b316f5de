"""The CPU loops' runtime dispatch (csrc/cpu/cpu_isa.h): every instruction set this CPU has gives the same bits as the
x86-64 baseline, for the mix and optimizer ops (with the disagreement sum), the int8 codec and the mixes that
dequantize the 8-bit wire's payloads; a bad
DECENT_COMM_CPU_ISA is a clear error."""

import os
import subprocess
import sys

import pytest

from decent_comm import _native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ORDER = ["baseline", "avx2", "avx512"]

# Runs every op family on fixed inputs and prints the instruction set and one digest of all outputs' bytes.
SCRIPT = r"""
import hashlib, torch
from decent_comm import ops, _native
h = hashlib.sha256()
def eat(*ts):
    for t in ts:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
for n in [1, 7, 4097, 100_003]:
    for k in [0, 1, 2, 3, 5]:
        for nd in [torch.float32, torch.bfloat16]:
            for xd in [torch.float32, torch.bfloat16, torch.float16, torch.float64]:
                g = torch.Generator().manual_seed(n * 31 + k)
                x = torch.randn(n, generator=g).to(xd)
                ys = [torch.randn(n, generator=g).to(nd) for _ in range(k)]
                grad = torch.randn(n, generator=g).to(xd)
                m, v, a = torch.randn(n, generator=g), torch.rand(n, generator=g), torch.randn(n, generator=g)
                w = [0.5 / max(k, 1)] * k
                d = torch.zeros(1)
                ops.mix_adam_(x, ys, 0.5, w, grad, m, v, 3, 1e-3, weight_decay=0.01, decoupled=True, disagreement=d)
                x2, b = torch.randn(n, generator=g).to(xd), torch.randn(n, generator=g)
                ops.mix_sgd_(x2, ys, 0.5, w, grad, b, 0.1, momentum=0.9, nesterov=True)
                x3 = torch.randn(n, generator=g).to(xd)
                ops.mix_accum_adam_(x3, ys, 0.5, w, grad, m, v, a, 4, 2, 1e-3, weight_decay=0.1)
                x4, d4 = torch.randn(n, generator=g).to(xd), torch.zeros(1)
                ops.gossip_mix_(x4, ys, 0.5, w, disagreement=d4)
                eat(x, m, v, d, x2, b, x3, a, x4, d4)
g = torch.Generator().manual_seed(1)
for xd in [torch.float32, torch.bfloat16, torch.float64]:
    x, c = torch.randn(100_003, generator=g).to(xd), torch.randn(100_003, generator=g)
    p = torch.empty(ops.int8_payload_nbytes(100_003), dtype=torch.uint8)
    ops.int8_encode_(x, c, p)
    r = torch.randn(100_003, generator=g)
    ops.int8_dequantize_add_(r, p)
    eat(c, p, r)
for n in [7, 4097, 100_003]:  # the 8-bit wire's mix: P copies advanced inside the op, then the own copy
    for copies in [1, 2, 3, 5]:
        for xd in [torch.float32, torch.bfloat16]:
            g = torch.Generator().manual_seed(n + copies)
            pays = []
            for _ in range(copies):
                p = torch.empty(ops.int8_payload_nbytes(n + 3), dtype=torch.uint8)
                ops.int8_encode_(torch.randn(n + 3, generator=g), torch.zeros(n + 3), p)
                pays.append(p)
            cs = [torch.randn(n, generator=g) for _ in range(copies)]
            own, grad = torch.randn(n, generator=g), torch.randn(n, generator=g).to(xd)
            x, m, v = torch.randn(n, generator=g).to(xd), torch.randn(n, generator=g), torch.rand(n, generator=g)
            w, d = [0.5 / copies] * copies + [-0.5], torch.zeros(1)
            ops.mix_adam_(x, [own], 1.0, w, grad, m, v, 3, 1e-3, weight_decay=0.01, decoupled=True, disagreement=d,
                          copies=cs, payloads=pays, payload_offset=3)
            x4, d4 = torch.randn(n, generator=g).to(xd), torch.zeros(1)
            ops.gossip_mix_(x4, [own], 1.0, w, disagreement=d4, copies=cs, payloads=pays)
            eat(x, m, v, d, x4, d4, *cs)
print(_native.cpu_isa(), h.hexdigest())
"""


def _run(isa):
    env = dict(os.environ, DECENT_COMM_CPU_ISA=isa, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)


def test_every_instruction_set_gives_the_baseline_bits():
    best = _native.cpu_isa()
    if best == "baseline":
        pytest.skip("this CPU has only the baseline instruction set")
    runs = {isa: _run(isa) for isa in ORDER[:ORDER.index(best) + 1]}
    for isa, r in runs.items():
        assert r.returncode == 0, r.stderr[-2000:]
        assert r.stdout.split()[0] == isa, "DECENT_COMM_CPU_ISA must select the loops it names"
    digests = {isa: r.stdout.split()[1] for isa, r in runs.items()}
    assert len(set(digests.values())) == 1, digests


def test_a_bad_isa_name_is_a_clear_error():
    r = _run("sse9")
    assert r.returncode != 0 and "DECENT_COMM_CPU_ISA=sse9 is not one of baseline, avx2, avx512" in r.stderr
    above = {"baseline": "avx2", "avx2": "avx512"}.get(_native.cpu_isa())
    if above:
        r = _run(above)
        assert r.returncode != 0 and f"DECENT_COMM_CPU_ISA={above} but this CPU supports at most" in r.stderr
