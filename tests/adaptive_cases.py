"""What the multi-process adaptive-communication tests share (tests/test_adaptive.py,
tests/test_adaptive_decisions.py): the optimizer cases they check, a dense simulation that also records each
mix's displacement, a schedule of topologies written out independently of decent_comm's Adaptive, and the
per-bucket bookkeeping."""

from decent_comm import topology as T

from optim_cases import OPTIMIZERS as ALL_OPTIMIZERS
from optim_cases import doubly_stochastic
from optim_reference import Reference

STEPS = 20
# the cases whose disagreement and schedules these tests check
OPTIMIZERS = {k: ALL_OPTIMIZERS[k] for k in ("dadamw", "dsgd-nesterov", "accumadamw", "wrapped-adam")}


class RecordingReference(Reference):
    """The dense simulation, also recording every mix's per-rank squared displacement (mixed - x_old)^2."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.mix_sq = []  # per mix: [per rank: float64 vector of (mixed - x_old)^2]

    def _mix(self, W, X):
        out = super()._mix(W, X)
        self.mix_sq.append([(o - x) ** 2 for o, x in zip(out, X)])
        return out


class Scheduled:
    """An independent reference schedule: the matrix of the named topology active at each step."""

    def __init__(self, phases, topologies):
        self.phases = phases          # [(first step, name)], sorted
        self.topologies = topologies  # name -> Topology

    def name_at(self, t):
        return [name for start, name in self.phases if start <= t][-1]

    def matrix(self, t):
        return self.topologies[self.name_at(t)].matrix(t)

    def peers(self, rank, t):
        return self.topologies[self.name_at(t)].peers(rank, t)


def bucket_param_ranges(opt, model):
    """Per bucket: the [start, stop) ranges of its parameters in the reference's concatenated flat vector."""
    offsets, off = {}, 0
    for p in model.parameters():
        offsets[id(p)] = (off, off + p.numel())
        off += p.numel()
    return [[offsets[id(s.param)] for s in b.slots] for b in opt._buckets]


def per_bucket(vec, ranges):
    return [sum(float(vec[a:b].sum()) for a, b in rs) for rs in ranges]



def candidate_topologies(n):
    return {"one-peer-exp": T.make("one-peer-exp", n), "ring": T.make("ring", n), "complete": T.make("complete", n),
            "custom": T.from_matrix([doubly_stochastic(n, 1), doubly_stochastic(n, 2)])}
