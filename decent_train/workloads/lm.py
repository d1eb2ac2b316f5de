"""Train a small GPT-style byte-level language model with decentralized (gossip) data parallelism.

Data: the Python standard library's own source code, read from ``sysconfig.get_paths()["stdlib"]`` of the
running interpreter (top-level ``*.py`` files, sorted by name, ``_sysconfigdata*`` skipped, the first
--corpus-mb megabytes; every 10th file is held out for validation). It is real code present on every
machine, so nothing is downloaded; see decent_train/data.py. Each rank samples its own random windows.

    torchrun --standalone --nproc_per_node 4 examples/train_lm.py --optimizer dadamw --topology one-peer-exp
    torchrun --standalone --nproc_per_node 4 examples/train_lm.py --optimizer allreduce        # DDP + AdamW
    torchrun --standalone --nproc_per_node 4 examples/train_lm.py --optimizer accumadamw --topology aer \\
        --local-world-size 2                                  # aer as if on 2 nodes x 2 ranks
    GLOO_SOCKET_IFNAME=eth0 torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint HOST:29500 \\
        examples/train_lm.py --optimizer dadamw --topology aer --timeout 60  # multi-node: aer reads LOCAL_WORLD_SIZE

Multi-node: the same command on every node (HOST: one node's address, reachable from all), with GLOO_SOCKET_IFNAME
naming the network interface the nodes reach each other on (`ip -br addr` lists them): without it gloo takes its
address from the hostname, which many systems map to loopback (127.0.1.1 on Debian), and every rank fails with
"Gloo connectFullMesh failed ... Connection refused, remote=[127.0...]". On GPUs (nccl), NCCL_SOCKET_IFNAME picks
NCCL's interface where a node has several. --timeout bounds how long a rank waits for a peer that stopped (a dead
node or link); without it gloo waits 30 min.

Validation loss is that of the global average of the replicas; logs, plot and checkpoints: see --help.
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import cli, data
from ..flags import add_common_args, count, number
from ..task import Task

VOCAB = 256  # bytes
# All-reduce peak lr per optimizer family for the default model, 300 steps (docs/demo_results.md); decentralized
# Adam-family runs scale the Adam value (decent_train.flags.resolve_defaults, docs/quality_results.md). SGD (0.3 with
# momentum 0.9) is a reasonable setting, not a tuned one.
LR_DEFAULTS = {"adam": 3e-3, "sgd": 0.3}


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        if d_model % heads:
            raise ValueError(f"--d-model {d_model} is not divisible by --heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Pre-LayerNorm decoder-only transformer with learned positions and a tied output embedding."""

    def __init__(self, layers: int, d_model: int, heads: int, seq_len: int):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Parameter(torch.zeros(seq_len, d_model))
        self.blocks = nn.ModuleList(Block(d_model, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.apply(self._init)
        nn.init.normal_(self.pos, std=0.02)
        for block in self.blocks:  # GPT-2: scale the residual projections by depth so the stream stays O(1)
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * layers))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.tok.weight.t()


def build_task(args, env) -> Task:
    corpus = data.load_stdlib_corpus(int(args.corpus_mb * 1e6))
    # ValueErrors naming the flags (decent_train.cli: one line): a window longer than the text left random_windows
    # an empty range and the validation set empty (its loss NaN).
    for part, text in (("training", corpus.train), ("held-out", corpus.val)):
        if len(text) <= args.seq_len + 1:
            raise ValueError(f"--seq-len {args.seq_len} is longer than the {part} text of --corpus-mb "
                             f"{args.corpus_mb:g} ({len(text)} bytes): give a shorter --seq-len or a larger --corpus-mb")
    model = GPT(args.layers, args.d_model, args.heads, args.seq_len)
    val = data.eval_windows(corpus.val, args.seq_len, args.eval_tokens, args.batch_size, env.rank, env.world_size)
    return Task(
        model=model,
        sample_batch=lambda g: data.random_windows(corpus.train, args.batch_size, args.seq_len, g),
        val_batches=val, items_per_batch=args.batch_size * args.seq_len, item_name="tokens",
        description=corpus.describe(), model_flags=("layers", "d_model", "heads", "seq_len"))


def check_args(args):
    """The model and data flags against each other (ValueError naming them; cli.parse makes it one line)."""
    if args.d_model % args.heads:
        raise ValueError(f"--heads {args.heads} does not divide --d-model {args.d_model}")
    if args.eval_tokens < args.seq_len:  # no whole window to score: the validation loss was NaN
        raise ValueError(f"--eval-tokens {args.eval_tokens} is less than --seq-len {args.seq_len}: validation scores "
                         f"whole windows of --seq-len bytes; give --eval-tokens {args.seq_len} or more")
    least = data.min_corpus_bytes()
    if int(args.corpus_mb * 1e6) < least:  # no held-out file
        raise ValueError(f"--corpus-mb {args.corpus_mb:g} takes fewer than 10 files of the standard library, and every "
                         f"10th is held out for validation: give --corpus-mb {math.ceil(least / 1e4) / 100:g} or more")


def build_parser() -> argparse.ArgumentParser:
    parser = cli.make_parser(__doc__)
    add_common_args(parser, steps=300, batch_size=16, eval_every=50)
    g = parser.add_argument_group("model and data")
    g.add_argument("--layers", type=count(1), default=2, help="transformer blocks")
    g.add_argument("--d-model", type=count(1), default=128, help="model width")
    g.add_argument("--heads", type=count(1), default=4, help="attention heads")
    g.add_argument("--seq-len", type=count(1), default=64, help="context length in bytes")
    g.add_argument("--corpus-mb", type=number(0, strictly=True), default=3.0,
                   help="megabytes of stdlib source to use (train + held-out)")
    g.add_argument("--eval-tokens", type=count(1), default=65536,
                   help="held-out bytes scored at each evaluation (at least --seq-len)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return cli.parse(build_parser(), argv, check_args)


def main(argv=None) -> dict:
    return cli.main(parse_args, build_task, LR_DEFAULTS, argv)
