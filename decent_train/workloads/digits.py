"""Train a small CNN (or MLP) on scikit-learn's bundled 8x8 digits with decentralized data parallelism.

Data: ``sklearn.datasets.load_digits`` (1797 images, 10 classes; the data files ship inside the
scikit-learn wheel, nothing is downloaded; every 5th image is held out). Each rank samples its own random
mini-batches. Accuracy and loss are those of the global average of the replicas.

    torchrun --standalone --nproc_per_node 4 examples/train_classifier.py --optimizer dadamw
    torchrun --standalone --nproc_per_node 4 examples/train_classifier.py --optimizer allreduce
    torchrun --standalone --nproc_per_node 4 examples/train_classifier.py --optimizer dsgd --topology ring

Same optimizer, topology, schedule, logging and checkpoint flags as train_lm.py (see --help).
"""

import argparse

import torch.nn as nn

from .. import cli, data
from ..flags import add_common_args, count
from ..task import Task

LR_DEFAULTS = {"adam": 3e-3, "sgd": 0.05}


def make_model(kind: str, width: int, num_classes: int) -> nn.Module:
    if kind == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(64, 4 * width), nn.ReLU(), nn.Linear(4 * width, 4 * width),
                             nn.ReLU(), nn.Linear(4 * width, num_classes))
    # 8x8 -> conv -> 8x8 -> conv -> pool -> 4x4 -> linear
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(),
        nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(2 * width * 16, 4 * width), nn.ReLU(), nn.Linear(4 * width, num_classes))


def build_task(args, env) -> Task:
    ds = data.load_digits()
    return Task(
        model=make_model(args.model, args.width, ds.num_classes),
        sample_batch=lambda g: data.random_rows(ds.x_train, ds.y_train, args.batch_size, g),
        val_batches=data.shard_rows(ds.x_val, ds.y_val, 256, env.rank, env.world_size),
        items_per_batch=args.batch_size, item_name="samples", report_accuracy=True, description=ds.describe(),
        model_flags=("model", "width"))


def build_parser() -> argparse.ArgumentParser:
    parser = cli.make_parser(__doc__)
    add_common_args(parser, steps=1000, batch_size=16, eval_every=100)
    g = parser.add_argument_group("model")
    g.add_argument("--model", choices=("cnn", "mlp"), default="cnn", help="network")
    g.add_argument("--width", type=count(1), default=16, help="channels of the first conv layer (MLP: hidden / 4)")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return cli.parse(build_parser(), argv)


def main(argv=None) -> dict:
    return cli.main(parse_args, build_task, LR_DEFAULTS, argv)
