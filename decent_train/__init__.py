"""The training harness that the examples, the benchmarks and the tests share. It lives in the source checkout
and is not part of the decent_comm library (setup.py does not package it).

    flags        command-line flags of every training script, the checks across them, and the defaults that
                 depend on them (flag_sets: the decentralized-only ones, importable without torch)
    cli          the scripts' parser and main(): bad input is one line and exit code 2, Ctrl-C exits 130
    distributed  joining torchrun's job (rank, world, device) and leaving it; rank-tagged logging
    strategy     the optimizer factory: DDP all-reduce baseline or a decent_comm optimizer
    lr_schedule  constant / cosine / warmup-cosine learning rate
    task         what a workload provides (model, batches, validation shard) and its evaluation
    loop         the training loop (`run`): timing, logging, evaluation, checkpoints, stragglers
    runlog, plot the CSV/JSON logs and the loss plot
    checkpoint   per-rank checkpoints and a safe resume
    data         the offline datasets (standard-library source bytes, scikit-learn digits)
    workloads    lm (byte-level GPT), digits (CNN classifier), synthetic (compute-controlled model)
    cluster      an emulated multi-node cluster (network namespaces, shaped links, one torchrun per node)

How it is importable: `make build` writes a .pth file into the venv naming this checkout, so the venv's python
imports decent_comm (built in place) and decent_train from any directory (bench scripts, torchrun workers);
pytest adds the checkout itself (pyproject.toml `pythonpath`); the examples add it when run from a checkout.

Nothing is imported here, so `decent_train.cluster` (used by a driver that never trains) does not load torch.
"""

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
