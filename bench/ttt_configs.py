"""The training configurations bench/time_to_target.py (and bench/demo.py's cluster run) race, written as short
specs that say what runs:

    ddp                          torch DDP + AdamW (gradient all-reduce every step) at the workload's lr
    complete/atc/k8/s1300        DAdamW on `complete` in ATC mode, gossiping every 8th step (the group all-reduce
                                 path runs it as one all-reduce of the parameters: periodic averaging, what torch's
                                 PostLocalSGDOptimizer does), 1300-step schedule
    one-peer-exp/awc/k4/bf16     DAdamW on one-peer-exp, AWC, every 4th step, bf16 wire, the default steps

Tokens after the first (a topology name or spec, or `ddp`), separated by `/`, in any order:

    atc | awc      mode (default atc: equal-step quality within 2% of DDP, docs/quality_results.md)
    k<N>           --gossip-every N (local steps between gossip rounds)
    w<N>           --warmup-steps N (all-reduce the gradients for the first N steps)
    delayed        --delayed-mix (awc: a round's exchange overlaps the whole interval, mixed in at the next round)
    s<N>           steps, i.e. the length of the lr schedule (default: the benchmark's --steps)
    bf16           --bf16-wire (DDP: the bf16 compression hook)
    int8           --int8-wire (the 8-bit wire with error feedback; not for DDP)
    lr<X>          --lr X (default: the workload's all-reduce lr, x sqrt(n) for DAdamW: decentralized_adam_hparams)
    wu<N>          --warmup N, the lr warm-up steps (default 30% of the steps)
    accum          AccumAdamW (window 4, per-window betas) instead of DAdamW

ALIASES names the configurations a user picks from the README or the planner.
"""

from dataclasses import dataclass
from typing import List, Optional

ALIASES = {
    "periodic4": "complete/atc/k4",
    "periodic8": "complete/atc/k8",
    "periodic16": "complete/atc/k16",
}
MODES = ("atc", "awc")


@dataclass(frozen=True)
class Config:
    spec: str                   # as given (after alias expansion), also the run's label
    optimizer: str              # train script's --optimizer
    topology: Optional[str]
    steps: int
    flags: tuple                # train script flags, --steps excluded

    @property
    def is_ddp(self) -> bool:
        return self.optimizer == "allreduce"

    @property
    def is_periodic(self) -> bool:
        """Periodic averaging: an all-reduce of the parameters every k-th step (the baseline to beat)."""
        return self.topology == "complete" and "--gossip-every" in self.flags

    @property
    def dir_name(self) -> str:
        return "".join(c if c.isalnum() or c in "-." else "_" for c in self.spec)


def parse(text: str, default_steps: int) -> Config:
    """A Config from a spec (see the module docstring); ValueError naming the bad token."""
    head, *tokens = text.strip().split("/")
    spec = "/".join([ALIASES.get(head, head), *tokens])
    head, *tokens = spec.split("/")
    if not head:
        raise ValueError(f"config {text!r}: empty topology")
    ddp = head == "ddp"
    optimizer, mode, steps, flags = ("allreduce" if ddp else "dadamw"), None if ddp else "atc", default_steps, []
    for tok in tokens:
        if tok in MODES and not ddp:
            mode = tok
        elif tok == "bf16":
            flags.append("--bf16-wire")
        elif tok == "int8" and not ddp:
            flags.append("--int8-wire")
        elif tok == "delayed" and not ddp:
            flags.append("--delayed-mix")
        elif tok == "accum" and not ddp:
            optimizer = "accumadamw"
        elif tok.startswith("lr") and _number(tok[2:]) is not None:
            flags += ["--lr", tok[2:]]
        elif tok.startswith("wu") and tok[2:].isdigit():
            flags += ["--warmup", tok[2:]]
        elif tok[:1] in ("k", "w", "s") and tok[1:].isdigit() and not (ddp and tok[0] != "s"):
            value = int(tok[1:])
            if tok[0] == "s":
                steps = value
            else:
                flags += ["--gossip-every" if tok[0] == "k" else "--warmup-steps", str(value)]
        else:
            raise ValueError(f"config {text!r}: unknown token {tok!r} (see bench/ttt_configs.py)")
    if steps < 1:
        raise ValueError(f"config {text!r}: steps must be >= 1")
    base = ["--optimizer", optimizer] + ([] if ddp else ["--topology", head, "--mode", mode])
    return Config(spec=spec, optimizer=optimizer, topology=None if ddp else head, steps=steps,
                  flags=tuple(base + flags))


def parse_list(text: str, default_steps: int) -> List[Config]:
    """Comma-separated specs; a comma inside an adaptive topology spec (`adaptive:...:a,b`) is kept by
    separating configs with `;` instead when any spec holds one."""
    sep = ";" if ";" in text else ","
    return [parse(t, default_steps) for t in text.split(sep) if t.strip()]


def _number(text: str):
    try:
        return float(text)
    except ValueError:
        return None
