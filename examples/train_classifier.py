"""Train a small CNN (or MLP) on scikit-learn's bundled 8x8 digits with decentralized data parallelism.

    torchrun --standalone --nproc_per_node 4 examples/train_classifier.py --optimizer dadamw
    torchrun --standalone --nproc_per_node 4 examples/train_classifier.py --optimizer dsgd --topology ring
    torchrun --standalone --nproc_per_node 4 --max-restarts 3 examples/train_classifier.py --checkpoint ck --resume auto

The last restarts the job up to 3 times when a rank fails: each attempt goes on from the latest checkpoint in ck/
that every rank finished writing (the first, with none there, starts afresh).

The model and data are in decent_train/workloads/digits.py, the optimizer set-up and the training loop in
decent_train/strategy.py and decent_train/loop.py; `--help` lists every flag.
"""

import os
import sys

# From a source checkout (decent_comm built in place by `make build`): the repository root holds decent_comm and
# the decent_train harness. First on the path, so the checkout is what runs even where another copy is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

if __name__ == "__main__":
    try:  # Ctrl-C while importing torch and decent_comm (seconds): exit 130 without a traceback
        from decent_train.workloads import digits
    except KeyboardInterrupt:
        sys.exit(130)
    digits.main()  # bad input: one line and exit code 2; Ctrl-C in training: exit 130 (decent_train/cli.py)
