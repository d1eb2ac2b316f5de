"""What one step() hands between its parts, held on a plain object of its own rather than on the optimizer.

A step() called from a torch.compile'd function is traced by Dynamo, and torch 2.11's Dynamo cannot trace a setattr on
a torch.optim.Optimizer: it represents one without a mutation type (OptimizerVariable), and `self._closure = ...` in
a traced step() failed the compile with an AssertionError ("Attempted setattr on a user-defined object that does not
have an AttributeMutation mutation_type"; torch 2.14 traces it). A setattr on this object traces under both, so
step() sets nothing on the optimizer itself."""

from typing import Any, Callable, Optional


class StepVars:
    """closure: the closure the update evaluates (Decentralized hands it on to the wrapped optimizer), None without one
    or when step() evaluated it first; closure_loss: what the wrapped optimizer's step returned; amp: this step's
    GradScaler scalars for the fused kernels (decent_comm.optim.amp), None without them."""

    def __init__(self):
        self.closure: Optional[Callable] = None
        self.closure_loss: Any = None
        self.amp: Any = None
