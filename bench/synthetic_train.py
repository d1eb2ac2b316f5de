"""A compute-controlled training workload for the cluster benchmarks (decent_train/workloads/synthetic.py: a model
whose size and per-step compute time are set by flags), on the examples' training loop.

    torchrun --standalone --nproc_per_node 4 bench/synthetic_train.py --params 1M --compute-ms 100 \\
        --optimizer dadamw --topology one-peer-exp
"""

from decent_train.workloads import synthetic

if __name__ == "__main__":
    synthetic.main()
