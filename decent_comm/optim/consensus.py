"""Consensus-factor schedules for DSGD-AC (Wang & Johansson 2026, "Decentralized SGD with controlled
disagreement finds flatter minima"): the mixing matrix W becomes (1 - a) I + a W."""

from .._args import integer, is_real, real


class AdaptiveConsensus:
    """a = 1 before `start_step`; afterwards a = min_factor + (1 - min_factor) * (lr_t / lr_peak)^p.

    As the learning rate decays the replicas are allowed to disagree more (less averaging), which acts as a
    curvature-aware regularizer. lr_t is the learning rate of the first param group when the exchange of
    that step is launched; lr_peak is the largest lr_t from start_step on (saved in the optimizer's state_dict
    as "lr_at_start").
    The peak, not the lr at start_step: under a warm-up that start_step=0 (the default) leaves inside, the lr at
    step 0 is the warm-up's smallest, and every later lr looked at least as large (a = 1 until the decay fell
    below it: a 10-step warm-up from 1e-3 to 0.1 with a cosine to step 100 first lowered a at step 95). A
    schedule that only decays from start_step on sees the same reference either way.
    Each rank computes a from its own lr: the lr must be equal on every rank (a ReduceLROnPlateau stepped on each
    rank's own loss is not), or the ranks mix by a matrix that is not doubly stochastic and the replicas' mean drifts
    (docs/api.md, torch.optim conventions).
    """

    def __init__(self, p: float = 3.0, start_step: int = 0, min_factor: float = 0.0):
        # NaN p passed the range check and failed mid-training; start_step=0.5 was truncated to 0
        self.p = real(p, "p", low=0, where="AdaptiveConsensus")
        self.start_step = integer(start_step, "start_step", low=0, where="AdaptiveConsensus")
        self.min_factor = real(min_factor, "min_factor", 0, 1, where="AdaptiveConsensus")
        self.lr_peak = None

    def factor(self, step: int, lr: float) -> float:
        if step < self.start_step:
            return 1.0
        lr = float(lr)
        self.lr_peak = lr if self.lr_peak is None else max(self.lr_peak, lr)
        ratio = 1.0 if self.lr_peak <= 0 else min(1.0, max(0.0, lr / self.lr_peak))
        return self.min_factor + (1.0 - self.min_factor) * ratio ** self.p

    def state_dict(self):
        # Under the key of the versions that kept the lr at start_step (the peak of a schedule that only decays from
        # there): torch.distributed.checkpoint loads the keys a live optimizer has and requires the checkpoint to
        # hold them, so a renamed key made every earlier DCP checkpoint unloadable.
        return {"lr_at_start": self.lr_peak}

    def load_state_dict(self, state):
        peak = state.get("lr_at_start")
        # refused here, not at the next step's max() (the optimizer's load puts everything back: load_rollback.py)
        if peak is not None and not (is_real(peak) and peak == peak):  # NaN too
            raise ValueError(f"AdaptiveConsensus: the saved lr_at_start is {peak!r}, not an lr (a number or None)")
        self.lr_peak = peak

    def __repr__(self):
        return f"AdaptiveConsensus(p={self.p}, start_step={self.start_step}, min_factor={self.min_factor})"
