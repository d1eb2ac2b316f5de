"""The fused ops capture into CUDA graphs: no host synchronization, also on the AMP path (GradScaler's scale and
found_inf and the step count are read on the device), and replays give the eager results. Needs a GPU."""

import pytest
import torch

from decent_comm import ops

from op_inputs import flat, gen, random_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not ops.has_cuda_kernels(),
                                reason="needs a CUDA device and a build with the CUDA kernels")

N = 100_003  # odd: the vector loop and the scalar tail both run


class Step:
    """The static tensors of one op call and the call itself, so the same call runs eagerly or inside a graph."""

    def __init__(self, op, g):
        cuda = "cuda"
        self.op = op
        self.x = flat(N, torch.float32, cuda, gen=g)
        self.ys = [flat(N, torch.bfloat16, cuda, gen=g) for _ in range(2)]
        self.sw, self.ws = random_weights(2, g)
        self.grad = flat(N, torch.float32, cuda, gen=g)
        self.state = [torch.zeros(N, device=cuda) for _ in range(3)]
        self.disagreement = torch.zeros(1, device=cuda)
        self.grad_scale = torch.ones((), device=cuda)
        self.found_inf = torch.zeros((), device=cuda)
        self.count = torch.zeros((), device=cuda)  # float32, like torch.optim's state["step"]

    def run(self):
        amp = dict(grad_scale=self.grad_scale, found_inf=self.found_inf, state_step=self.count)
        mix = (self.x, self.ys, self.sw, self.ws)
        st, d = self.state, self.disagreement
        if self.op == "mix":
            ops.gossip_mix_(*mix, disagreement=d)
        elif self.op == "sgd":
            ops.mix_sgd_(*mix, self.grad, st[0], 0.1, 0.9, 0.1, 0.01, disagreement=d, **amp)
        elif self.op == "adam":
            ops.mix_adam_(*mix, self.grad, st[0], st[1], None, 1e-2, weight_decay=0.1, decoupled=True,
                          disagreement=d, **amp)
        else:
            ops.mix_accum_adam_(*mix, self.grad, *st, None, 3, 1e-2, disagreement=d, **amp)

    def feed(self, inputs):
        """Copies one step's inputs into the static tensors (what a training loop does before replay)."""
        grad, ys, scale, found_inf = inputs
        self.grad.copy_(grad)
        for y, new in zip(self.ys, ys):
            y.copy_(new)
        self.grad_scale.fill_(scale)
        self.found_inf.fill_(found_inf)

    def snapshot(self):
        return [self.x.clone(), self.count.clone()] + [s.clone() for s in self.state]


def _inputs(g, steps):
    """Per step: gradient, neighbours, scale, found_inf; steps 2 and 5 overflow."""
    return [(flat(N, torch.float32, "cuda", gen=g, scale=2.0 ** 8), [flat(N, torch.bfloat16, "cuda", gen=g)
                                                                     for _ in range(2)],
             2.0 ** 8, 1.0 if t in (2, 5) else 0.0) for t in range(steps)]


@pytest.mark.parametrize("op", ["mix", "sgd", "adam", "accum"])
def test_captured_op_replays_the_eager_results(op):
    eager, graphed = Step(op, gen(1)), Step(op, gen(1))
    inputs = _inputs(gen(2), 7)
    # warm up on a side stream (fills the kernels' occupancy caches), as torch.cuda.graphs asks
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    warm = Step(op, gen(3))
    with torch.cuda.stream(side):
        warm.run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if the op synchronizes with the host
        graphed.run()
    for t, step_inputs in enumerate(inputs):
        eager.feed(step_inputs)
        eager.run()
        graphed.feed(step_inputs)
        graph.replay()
        for a, b in zip(eager.snapshot(), graphed.snapshot()):
            assert torch.equal(a, b), f"step {t}"  # same kernels, same inputs: the same bits
        torch.testing.assert_close(graphed.disagreement, eager.disagreement, rtol=1e-5, atol=0)  # atomics' order
    if op != "mix":
        assert float(graphed.count) == 5  # 7 steps, 2 skipped
