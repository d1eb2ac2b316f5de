"""Fault injection for the reliability matrix (bench/fault_matrix.py, tests/test_faults.py, docs/reliability.md).

    scenarios  what each rank of a faulty job does: the fault, the training around it, what it records
    worker     the per-rank entry point (`python -m decent_train.faults.worker`): joins the job, runs a scenario
    launch     starts a job's ranks as separate processes in torchrun's worker environment (or under torchrun
               itself) and collects each rank's record, exit code and stderr
    verdict    judges a job: a clear error on every live rank within timeout + 5 s, no signal death, no hang

Nothing is imported here, so the launcher side does not load torch before it must.
"""
