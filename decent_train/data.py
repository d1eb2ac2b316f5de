"""Datasets for the examples, all available offline: nothing is downloaded at run time.

* Code corpus (train_lm.py): the Python standard library's own source files, i.e. the top-level ``*.py``
  files of ``sysconfig.get_paths()["stdlib"]`` (for this venv: /root/.pyenv/versions/3.11.7/lib/python3.11).
  Real, human-written code that every Python installation ships. The subset is deterministic for a given
  Python version: file names sorted, the machine-generated ``_sysconfigdata*`` files skipped, files taken
  in order until ``max_bytes``; every ``val_every``-th file of that list is held out for validation, so no
  text of a validation file is ever trained on. Modelled as raw bytes (vocabulary 256).
* Digits (train_classifier.py): scikit-learn's bundled 8x8 handwritten digits
  (``sklearn.datasets.load_digits``, 1797 images of 10 classes, shipped inside the sklearn wheel);
  every ``val_every``-th image is held out.

Batches are drawn with an explicit torch.Generator so that each rank draws different data (the generator is
seeded by rank) and so that a checkpoint can save and restore exactly where the stream was.
"""

import os
import sysconfig
from dataclasses import dataclass, field
from typing import List, Tuple

import torch

Batch = Tuple[torch.Tensor, torch.Tensor]


# ------------------------------------------------------------------------------------------- byte corpus

@dataclass
class TextCorpus:
    train: torch.Tensor          # uint8 bytes of the training files, concatenated
    val: torch.Tensor            # uint8 bytes of the held-out files, concatenated
    source: str                  # directory the files came from
    train_files: List[str] = field(default_factory=list)
    val_files: List[str] = field(default_factory=list)

    def describe(self) -> str:
        return (f"stdlib corpus {self.source}: {len(self.train_files)} train files ({len(self.train) / 1e6:.2f} MB), "
                f"{len(self.val_files)} held-out files ({len(self.val) / 1e6:.2f} MB)")


def stdlib_files(max_bytes: int) -> Tuple[str, List[str]]:
    """The deterministic sorted subset of the standard library's top-level source files."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py") and not n.startswith("_sysconfigdata"))
    chosen, total = [], 0
    for name in names:
        if total >= max_bytes:
            break
        chosen.append(name)
        total += os.path.getsize(os.path.join(root, name))
    if not chosen:
        raise RuntimeError(f"no Python source files found in the standard library directory {root}")
    return root, chosen


def min_corpus_bytes(val_every: int = 10) -> int:
    """The smallest max_bytes that takes val_every files, so that one is held out: validation needs one."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(root) if n.endswith(".py") and not n.startswith("_sysconfigdata"))
    return sum(os.path.getsize(os.path.join(root, n)) for n in names[:val_every - 1]) + 1


def load_stdlib_corpus(max_bytes: int = 3_000_000, val_every: int = 10) -> TextCorpus:
    root, names = stdlib_files(max_bytes)
    if len(names) < val_every:  # no held-out file: torch.frombuffer refused the empty validation text
        raise ValueError(f"{max_bytes} bytes of the standard library are {len(names)} files, and every "
                         f"{val_every}th file is held out for validation: take at least {min_corpus_bytes(val_every)} "
                         "bytes")
    # Held out by whole file (not a tail of the stream): validation measures generalization to unseen modules.
    val_names = names[val_every - 1::val_every]
    held = set(val_names)
    train_names = [n for n in names if n not in held]

    def read(files):
        blob = b"".join(open(os.path.join(root, n), "rb").read() + b"\n" for n in files)
        return torch.frombuffer(bytearray(blob), dtype=torch.uint8)

    return TextCorpus(read(train_names), read(val_names), root, train_names, val_names)


def random_windows(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator) -> Batch:
    """batch_size random windows of seq_len bytes; targets are the inputs shifted by one byte."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def eval_windows(data: torch.Tensor, seq_len: int, max_tokens: int, batch_size: int, rank: int,
                 world_size: int) -> List[Batch]:
    """This rank's shard of a fixed validation set: the first max_tokens bytes cut into non-overlapping
    windows (the same windows for every run, so runs are compared on identical text)."""
    n_windows = min(max_tokens, len(data) - 1) // seq_len
    starts = torch.arange(n_windows)[rank::world_size] * seq_len
    batches = []
    for s in starts.split(batch_size):
        idx = s[:, None] + torch.arange(seq_len + 1)
        chunk = data[idx].long()
        batches.append((chunk[:, :-1], chunk[:, 1:]))
    return batches


# ---------------------------------------------------------------------------------------------- digits

@dataclass
class ImageSet:
    x_train: torch.Tensor        # float32 [N, 1, 8, 8] in [0, 1]
    y_train: torch.Tensor        # int64 [N]
    x_val: torch.Tensor
    y_val: torch.Tensor
    num_classes: int

    def describe(self) -> str:
        return (f"sklearn digits: {len(self.y_train)} train / {len(self.y_val)} held-out 8x8 images, "
                f"{self.num_classes} classes")


def load_digits(val_every: int = 5) -> ImageSet:
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:  # a dev dependency, not a runtime one of decent_comm
        raise SystemExit("train_classifier.py needs scikit-learn (pip install scikit-learn): its bundled "
                         "digits dataset is the training data") from e
    digits = sk_load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # pixel values are 0..16
    y = torch.tensor(digits.target, dtype=torch.long)
    held = torch.zeros(len(y), dtype=torch.bool)
    held[val_every - 1::val_every] = True
    return ImageSet(x[~held], y[~held], x[held], y[held], int(y.max()) + 1)


def random_rows(x: torch.Tensor, y: torch.Tensor, batch_size: int, generator: torch.Generator) -> Batch:
    idx = torch.randint(0, len(y), (batch_size,), generator=generator)
    return x[idx], y[idx]


def shard_rows(x: torch.Tensor, y: torch.Tensor, batch_size: int, rank: int, world_size: int) -> List[Batch]:
    """This rank's shard of the (fixed) validation rows, in batches."""
    xs, ys = x[rank::world_size], y[rank::world_size]
    return list(zip(xs.split(batch_size), ys.split(batch_size)))
