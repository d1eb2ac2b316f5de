"""The int8 wire as the dense simulation models it, written apart from decent_comm.optim.int8_wire: the block
quantizer in numpy float32 (absmax / 127 scales; levels: d times the float32 127 / absmax, rounded half to even,
-127..127, as decent_comm.ops.int8_encode_ states), and the public copies, one per
(rank, the ranks it sends to), that sender and receivers hold identically (so the simulation keeps one)."""

import numpy as np
import torch

BLOCK = 512


def roundtrip32(d: np.ndarray, block: int = BLOCK) -> np.ndarray:
    """deq(Q(d)) for a float32 vector: what a receiver adds to its copy."""
    n = d.size
    nb = -(-n // block)
    blocks = np.zeros(nb * block, np.float32)
    blocks[:n] = d
    blocks = blocks.reshape(nb, block)
    amax = np.abs(blocks).max(axis=1)
    scale = amax / np.float32(127)
    inv = np.zeros_like(amax)
    nz = amax > 0
    inv[nz] = np.float32(127) / amax[nz]
    q = np.clip(np.rint(blocks * inv[:, None]), -127, 127).astype(np.int8)
    return (q.astype(np.float32) * scale[:, None]).reshape(-1)[:n], q.reshape(-1)[:n], scale


class PublicCopies:
    def __init__(self, topology, n):
        self.topology, self.n = topology, n
        self.copies = {}

    def encode(self, X, observed, r):
        """Every rank sends Q(x - copy) for round r (topology step r) and the copies advance; returns each rank's
        copy for its receivers of round r (float64). `observed`: the float32 values the ranks really quantized
        (their parameters, which the simulation's float64 values must match), so that both quantize the same
        inputs; without it, the simulation's own values rounded to float32."""
        Z = []
        for k in range(self.n):
            x32 = X[k].float() if observed is None else observed[k]
            assert (x32.double() - X[k]).abs().max() < 1e-4, "the ranks left the simulated trajectory"
            key = (k, tuple(self.topology.peers(k, r).send))
            copy = self.copies.setdefault(key, np.zeros(x32.numel(), np.float32))
            copy += roundtrip32(x32.numpy() - copy)[0]
            Z.append(torch.from_numpy(copy.copy()).double())
        return Z
