"""The models and data the training scripts train, each a module with `LR_DEFAULTS`, `build_task(args, env)`,
`parse_args(argv)` and `main(argv)` (run by examples/train_lm.py, examples/train_classifier.py,
bench/synthetic_train.py, and in-process by bench/cluster_worker.py):

    lm         byte-level GPT on the Python standard library's source
    digits     small CNN / MLP on scikit-learn's bundled 8x8 digits
    synthetic  a model whose size and compute time (a sleep) are set by flags, for the cluster benchmarks
"""
