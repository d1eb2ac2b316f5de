"""decent_comm: decentralized data-parallel training for PyTorch.

Fused gossip-mix kernels (CPU and CUDA), a C++ exchange scheduler, communication topologies and drop-in
decentralized optimizers.
"""

from . import topology  # noqa: F401  (pure Python; no native code needed)
from . import ops  # noqa: F401  (loads the native extension and registers torch.ops.decent_comm.*)

__version__ = "0.1.0"
