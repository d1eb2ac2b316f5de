"""Consensus-factor schedules for DSGD-AC (Wang & Johansson 2026, "Decentralized SGD with controlled
disagreement finds flatter minima"): the mixing matrix W becomes (1 - a) I + a W."""


class AdaptiveConsensus:
    """a = 1 before `start_step`; afterwards a = min_factor + (1 - min_factor) * (lr_t / lr_at_start)^p.

    As the learning rate decays the replicas are allowed to disagree more (less averaging), which acts as a
    curvature-aware regularizer. lr_t is the learning rate of the first param group when the exchange of
    that step is launched; lr_at_start is recorded at start_step and saved in the optimizer's state_dict.
    """

    def __init__(self, p: float = 3.0, start_step: int = 0, min_factor: float = 0.0):
        if p < 0:
            raise ValueError(f"p must be >= 0, got {p}")
        if start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {start_step}")
        if not 0.0 <= min_factor <= 1.0:
            raise ValueError(f"min_factor must be in [0, 1], got {min_factor}")
        self.p, self.start_step, self.min_factor = float(p), int(start_step), float(min_factor)
        self.lr_at_start = None

    def factor(self, step: int, lr: float) -> float:
        if step < self.start_step:
            return 1.0
        if self.lr_at_start is None:
            self.lr_at_start = float(lr)
        ratio = 1.0 if self.lr_at_start <= 0 else min(1.0, max(0.0, float(lr) / self.lr_at_start))
        return self.min_factor + (1.0 - self.min_factor) * ratio ** self.p

    def state_dict(self):
        return {"lr_at_start": self.lr_at_start}

    def load_state_dict(self, state):
        self.lr_at_start = state.get("lr_at_start")

    def __repr__(self):
        return f"AdaptiveConsensus(p={self.p}, start_step={self.start_step}, min_factor={self.min_factor})"
