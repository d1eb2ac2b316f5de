"""A single-process dense simulation of all ranks of a decentralized optimizer, in float64.

X^{t+1} = W'(t) X^t - lr D(G)   (awc)      X^{t+1} = W'(t) (X^t - lr D(G))   (atc)

(with gossip_every k and warmup_steps w: W' = I and G the ranks' mean gradient for t < w; W' = I when
(t - w) % k != 0; otherwise the topology's W((t - w) / k))

delayed_mix (awc): a round's step mixes the previous round's copies Z (the parameters after that round's update,
rounded to the wire dtype) as a correction, X_i <- X_i + sum_{j != i} W'_ij (Z_j - Z_i), before its update; the
first round mixes nothing.

with W'(t) = (1 - a) I + a W(t) taken from topology.matrix(t), the replicas' parameters as rows of X, the
gradients from a float64 copy of the model, and the update directions from the formulas in
mix_reference.py (not from the kernels).

bf16/fp16 wire (the parameters are float32): a point-to-point step mixes the rounded copies Z = wire(X) in
difference form, X_i + sum_{j != i} W'_ij (Z_j - Z_i); a group step (W(t) averages uniformly within groups, one of
>= 3 ranks: run as all-reduces) sums unrounded, X <- W' X; delayed_mix's copies of a group round are unrounded too.

int8 wire (wire_dtype torch.int8): on a gossip round every rank advances its public copy Z by the quantized
change (tests/int8_reference.py) and the mix uses the copies, X_i + sum_{j != i} W'_ij (Z_j - Z_i) (AWC: of x^t, ATC:
of the half step, delayed_mix: the copies of the previous round as the correction).

overflow (GradScaler): the (rank, t) pairs whose gradient overflows. That rank skips its update at t (AWC:
x <- its mix; ATC: x is mixed un-updated), its state and step count stay; in the warm-up (the gradients are
all-reduced) every rank skips.
"""

import torch
from torch.func import functional_call

from int8_reference import PublicCopies
from mix_reference import accum_adam64, adam64, sgd64


class Reference:
    def __init__(self, model, init_flats, topology, mode, kind, hp, consensus=1.0, wire_dtype=None, gossip_every=1,
                 warmup_steps=0, delayed_mix=False, overflow=()):
        self.model = model.double()
        self.names = [n for n, _ in model.named_parameters()]
        self.shapes = [p.shape for _, p in model.named_parameters()]
        self.X = [x.double().clone() for x in init_flats]          # one flat vector per rank
        self.n = len(self.X)
        self.topology, self.mode, self.kind, self.hp = topology, mode, kind, hp
        self.consensus = consensus
        self.wire_dtype = wire_dtype
        self.gossip_every, self.warmup_steps = gossip_every, warmup_steps
        self.delayed_mix = delayed_mix
        self.sent = None  # delayed_mix: (W' of the round in flight, the copies Z sent)
        self.copies = PublicCopies(topology, self.n) if wire_dtype == torch.int8 else None
        self.state = [dict(m=torch.zeros_like(x), v=torch.zeros_like(x), a=torch.zeros_like(x),
                           b=torch.zeros_like(x)) for x in self.X]
        self.t = 0
        self.counts = [0] * self.n  # updates applied per rank (an overflow-skipped step does not count)
        self.overflow = set(overflow)
        self.skipping = set()  # ranks that skip the update of the current step

    def _params(self, flat):
        out, off = {}, 0
        for name, shape in zip(self.names, self.shapes):
            k = int(torch.Size(shape).numel())
            out[name] = flat[off:off + k].view(shape)
            off += k
        return out

    def grad(self, flat, batch):
        flat = flat.detach().clone().requires_grad_(True)
        x, y = batch
        out = functional_call(self.model, self._params(flat), (x.double(),))
        loss = ((out - y.double()) ** 2).mean()
        (g,) = torch.autograd.grad(loss, flat)
        return g

    def _W(self):
        """W'(t); the identity on warm-up and local steps; gossip round r uses the topology's W(r)."""
        since = self.t - self.warmup_steps
        if since < 0 or since % self.gossip_every:
            return torch.eye(self.n, dtype=torch.float64)
        W = torch.from_numpy(self.topology.matrix(since // self.gossip_every)).double()
        a = self.consensus(self.t) if callable(self.consensus) else self.consensus
        return (1 - a) * torch.eye(self.n, dtype=torch.float64) + a * W

    def _wire(self, x):
        return x.to(self.wire_dtype).double() if self.wire_dtype is not None else x

    def _lossy(self):
        return self.wire_dtype in (torch.bfloat16, torch.float16)

    def _group_round(self):
        """Whether this round's W averages uniformly within groups, one of >= 3 ranks (then all-reduced)."""
        since = self.t - self.warmup_steps
        W = self.topology.matrix(since // self.gossip_every)
        support = [frozenset(j for j in range(self.n) if W[i, j] > 1e-12) for i in range(self.n)]
        uniform = all(abs(W[i, j] - 1 / len(support[i])) < 1e-9 and support[j] == support[i]
                      for i in range(self.n) for j in support[i])
        return uniform and max(len(g) for g in support) >= 3

    def _correct(self, X):
        """delayed_mix: X_i + sum_{j != i} W'_ij (Z_j - Z_i) with the round in flight, on a gossip round."""
        if self.sent is None or not self._is_round():
            return X
        return self._diff_mix(*self.sent, X)

    def _diff_mix(self, W, Z, X):
        return [X[i] + sum(W[i, j] * (Z[j] - Z[i]) for j in range(self.n) if j != i) for i in range(self.n)]

    def _sent_copies(self, X, observed):
        """What a round sends: the int8 wire's public copies (after this round's change), else X on the wire."""
        if self.copies is not None:
            return self.copies.encode(X, observed, (self.t - self.warmup_steps) // self.gossip_every)
        return list(X) if self._lossy() and self._group_round() else [self._wire(x) for x in X]

    def _is_round(self):
        since = self.t - self.warmup_steps
        return since >= 0 and since % self.gossip_every == 0

    def _mix(self, W, X):
        lossy = self._lossy() and self._is_round()
        if lossy and not self._group_round():
            return self._diff_mix(W, [self._wire(x) for x in X], X)
        out = []
        for i in range(self.n):
            acc = W[i, i] * X[i]
            for j in range(self.n):
                if j != i and W[i, j] != 0:
                    y = X[j] if lossy else self._wire(X[j])
                    acc = acc + W[i, j] * y
            out.append(acc)
        return out

    def _direction(self, i, x_old, mixed, g):
        if i in self.skipping:
            return mixed
        hp, st, step = self.hp, self.state[i], self.counts[i] + 1
        self.counts[i] += 1
        if self.kind == "sgd":
            x, st["b"] = sgd64(x_old, mixed, g, st["b"], hp["lr"], hp.get("momentum", 0.0), hp.get("dampening", 0.0),
                               hp.get("weight_decay", 0.0), hp.get("nesterov", False), first_step=step == 1)
            return x
        if self.kind in ("adam", "adamw"):
            x, st["m"], st["v"] = adam64(x_old, mixed, g, st["m"], st["v"], step, hp["lr"], hp["betas"][0],
                                         hp["betas"][1], hp["eps"], hp["weight_decay"], self.kind == "adamw")
            return x
        x, st["m"], st["v"], st["a"] = accum_adam64(x_old, mixed, g, st["m"], st["v"], st["a"], step,
                                                    hp["accum_steps"], hp["lr"], hp["betas"][0], hp["betas"][1],
                                                    hp["eps"], hp["weight_decay"], self.kind == "accumadamw")
        return x

    def step(self, batches, observed_before=None, observed_after=None):
        """One step of every rank. observed_before / after: the ranks' parameters before and after it (float32),
        which the int8 wire's quantizer takes as its inputs where the ranks quantize them."""
        G = [self.grad(self.X[i], batches[i]) for i in range(self.n)]
        self.skipping = {i for i in range(self.n) if (i, self.t) in self.overflow}
        if self.t < self.warmup_steps:  # warm-up: every rank steps with the mean gradient (DDP)
            G = [sum(G) / self.n] * self.n
            self.skipping = set(range(self.n)) if self.skipping else set()
        W = self._W()
        if self.delayed_mix:
            mixed = self._correct(self.X)
            self.X = [self._direction(i, self.X[i], mixed[i], G[i]) for i in range(self.n)]
            if self._is_round():
                self.sent = (W, self._sent_copies(self.X, observed_after))
        elif self.mode == "awc":
            if self.copies is not None and self._is_round():
                mixed = self._diff_mix(W, self._sent_copies(self.X, observed_before), self.X)
            else:
                mixed = self._mix(W, self.X)
            self.X = [self._direction(i, self.X[i], mixed[i], G[i]) for i in range(self.n)]
        else:
            half = [self._direction(i, self.X[i], self.X[i], G[i]) for i in range(self.n)]
            if self.copies is not None and self._is_round():
                self.X = self._diff_mix(W, self._sent_copies(half, observed_after), half)
            else:
                self.X = self._mix(W, half)
        self.t += 1
