"""The job this process belongs to: joining the process group torchrun describes (and leaving it), the rank,
world and device, each rank's data seed, and log lines tagged with the rank."""

import datetime
import logging
import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

log = logging.getLogger(__name__)


def setup_logging(rank: int):
    """INFO from rank 0, warnings and errors from every rank, each line tagged with its rank. Python warnings too
    (decent_comm says what a user should act on with warnings.warn): written to stderr by the warnings module, they
    landed on rank 0's progress bar line, which log lines go around."""
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, force=True,
                        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.captureWarnings(True)


@dataclass
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: torch.device = torch.device("cpu")
    owns_group: bool = False     # we created the process group, so we destroy it

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", timeout: Optional[float] = None) -> DistEnv:
    """Joins the job torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, ... in the environment; --standalone or a
    multi-node c10d rendezvous). gloo on CPU, nccl on GPU, on keys of this torchrun restart attempt
    (init_process_group_per_attempt), so that `--max-restarts` can bring a one-node job back; across nodes restarts
    are not supported (docs/restarts.md: the agents' restart counts may differ), which it warns about. `timeout`
    (seconds, --timeout): the group's timeout once the ranks have joined (set_group_timeout); joining keeps the
    backend's default. A group that already exists (tests) is reused, its timeout left as its creator set it;
    without torchrun the example runs as a single process."""
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    env = DistEnv(local_rank=local_rank)
    if use_cuda:
        torch.cuda.set_device(local_rank)
        env.device = torch.device("cuda", local_rank)
    if not dist.is_initialized() and launched():
        init_process_group_per_attempt("nccl" if use_cuda else "gloo", device_id=env.device if use_cuda else None)
        env.owns_group = True
        if timeout is not None:
            set_group_timeout(datetime.timedelta(seconds=timeout))
    if dist.is_initialized():  # (one process: a LOCAL_WORLD_SIZE inherited from a launcher is not its own)
        env.rank, env.world_size = dist.get_rank(), dist.get_world_size()
        env.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
    return env


# What torchrun sets beside WORLD_SIZE: without them there is no job to join, only a WORLD_SIZE left in the shell.
LAUNCH_VARS = ("RANK", "MASTER_ADDR", "MASTER_PORT")


class LaunchError(ValueError):
    """WORLD_SIZE names several processes, but the variables torchrun sets beside it are not set."""


def launched() -> bool:
    """Whether this process is a rank of a job to join: WORLD_SIZE and torchrun's other variables. WORLD_SIZE=1
    alone is one process (docs/api.md says to set it so); a larger one alone is refused (LaunchError) rather than
    handed to torch's env:// rendezvous, which raised a traceback naming RANK."""
    world = os.environ.get("WORLD_SIZE")
    if world is None:
        return False
    missing = [v for v in LAUNCH_VARS if v not in os.environ]
    if not missing:
        return True
    if world.strip() == "1":
        return False
    raise LaunchError(f"WORLD_SIZE={world} but {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: "
                      "launch the job with torchrun, or unset WORLD_SIZE (or set it to 1) for one process")


def set_group_timeout(timeout: datetime.timedelta):
    """The default group's timeout from now on: how long its collectives (DDP's all-reduce, evaluation's and the
    checkpoints' all-reduces and barriers) wait for a rank before raising. Set after the join, not passed to
    init_process_group: under torchrun gloo's connectFullMesh waits for the other ranks with the group's timeout,
    and the workers of the nodes start seconds apart (importing torch), which a timeout chosen for a step (seconds)
    would turn into a failed start."""
    # dist.set_timeout is torch 2.14's public name; 2.11 (the oldest torch supported) has only the private one
    (getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout)(timeout)


def restart_attempt() -> int:
    """torchrun's restart count of this job (TORCHELASTIC_RESTART_COUNT): 0 for its first attempt and outside
    torchrun."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def init_process_group_per_attempt(backend: str, timeout: Optional[datetime.timedelta] = None, **kwargs):
    """dist.init_process_group(backend) as env:// rendezvouses (RANK, WORLD_SIZE, MASTER_ADDR/PORT: torchrun's
    agent's store, or rank 0's), with the group's keys under a prefix of this restart attempt: docs/restarts.md's
    recipe for `torchrun --max-restarts` ("Restarts"). The attempts share the agent's store and a plain group's keys
    carry no attempt number, so a restarted rank could read a dead rank's address from the attempt before and fail
    in gloo's connectFullMesh ("Connection refused"). The store's timeout is `timeout`, else the backend's default
    group timeout (nccl 10 min, else 30 min), as a plain init_process_group sets it; kwargs (device_id, ...) go to
    init_process_group, except init_method, store, rank and world_size, which the env:// rendezvous decides (a
    ValueError: they were passed on beside it, a TypeError or torch's own refusal)."""
    chosen = sorted(set(kwargs) & {"init_method", "store", "rank", "world_size"})
    if chosen:
        raise ValueError(f"init_process_group_per_attempt joins by env:// (RANK, WORLD_SIZE, MASTER_ADDR/PORT) under "
                         f"a prefix of this attempt: it takes no {', '.join(chosen)}")
    timeout = timeout or (default_pg_nccl_timeout if backend == "nccl" and default_pg_nccl_timeout is not None
                          else default_pg_timeout)
    attempt, across_nodes = restart_attempt(), restarts_across_nodes()
    if across_nodes and int(os.environ.get("LOCAL_RANK", 0)) == 0:  # once per node
        log.warning("torchrun --max-restarts with %s nodes: restarts are supported on one node only "
                    "(docs/restarts.md): torchrun counts restarts per node, so after a restart the nodes' ranks may "
                    "join under different attempt numbers and wait for each other until the timeout",
                    os.environ["GROUP_WORLD_SIZE"])
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    try:
        dist.init_process_group(backend, store=dist.PrefixStore(f"attempt{attempt}", store), rank=rank,
                                world_size=world_size, timeout=timeout, **kwargs)
    except dist.DistStoreError as e:
        # The group's keys carry the attempt number: ranks at different numbers never meet, and torch's error named
        # only a key ("wait timeout ... keys: /attempt1/0//cpu//0/1"), after the timeout (30 min by default on gloo).
        if "timeout" not in str(e) or not (attempt > 0 or across_nodes):
            raise
        raise RendezvousTimeout(
            f"the process group of torchrun restart attempt {attempt} (this rank's TORCHELASTIC_RESTART_COUNT) "
            f"timed out waiting for the other ranks ({' '.join(str(e).split())}): the ranks' restart counts may "
            "differ (torchrun counts restarts per node, and a node restarted for a membership change keeps its "
            "count), so they wait under different attempt numbers; restarts are supported on one node only "
            "(docs/restarts.md)") from e


class RendezvousTimeout(RuntimeError):
    """A restarted attempt's process group timed out waiting for its ranks (init_process_group_per_attempt)."""


def restarts_across_nodes() -> bool:
    """torchrun started several agents (GROUP_WORLD_SIZE, its node count) and allows restarts: the case
    init_process_group_per_attempt does not remedy."""
    return int(os.environ.get("GROUP_WORLD_SIZE", 1)) > 1 and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)) > 0


def job_world_size() -> int:
    """The world size init_distributed will find, known before it joins: checks against it that fail then are said
    before any rank connects (a rank failing right after joining closed its connections while another rank was
    still in gloo's connectFullMesh, which then failed with a traceback)."""
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ["WORLD_SIZE"]) if launched() else 1


def close_distributed(env: DistEnv):
    if env.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def rank_seed(seed: int, rank: int) -> int:
    """Each rank draws different data; a large odd multiplier keeps (seed, rank) pairs from colliding."""
    return (seed * 1_000_003 + rank * 7919 + 1) % (2 ** 63)
