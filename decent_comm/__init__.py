"""decent_comm: decentralized data-parallel training for PyTorch.

Fused gossip-mix kernels (CPU and CUDA), a C++ exchange scheduler, communication topologies and drop-in
decentralized optimizers:

    opt = decent_comm.DAdamW(model.parameters(), lr=3e-4, topology="one-peer-exp")
"""

from . import topology  # noqa: F401  (pure Python; no native code needed)
from . import ops  # noqa: F401  (loads the native extension and registers torch.ops.decent_comm.*)
from . import runtime_model  # noqa: F401  (pure Python: predicted step times and the planner)
from .exchange import ExchangeError, ExchangeTimeout  # what a step raises for a dead, slow or mismatched peer
from .optim import (DSGD, AccumAdam, AccumAdamW, AdaptiveConsensus, DAdam, DAdamW, Decentralized,
                    decentralized_adam_hparams)

__version__ = "0.1.0"
__all__ = ["DSGD", "DAdam", "DAdamW", "AccumAdam", "AccumAdamW", "Decentralized", "AdaptiveConsensus",
           "decentralized_adam_hparams", "ExchangeError", "ExchangeTimeout", "topology", "ops", "runtime_model"]
