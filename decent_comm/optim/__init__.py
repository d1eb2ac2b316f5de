"""Decentralized optimizers: drop-in torch.optim replacements that gossip with a topology's neighbours."""

from .base import MODES, DecentralizedMixin
from .consensus import AdaptiveConsensus
from .fused import DSGD, AccumAdam, AccumAdamW, DAdam, DAdamW
from .hparams import decentralized_adam_hparams
from .wrapper import Decentralized

__all__ = ["DSGD", "DAdam", "DAdamW", "AccumAdam", "AccumAdamW", "Decentralized", "AdaptiveConsensus",
           "DecentralizedMixin", "MODES", "decentralized_adam_hparams"]
