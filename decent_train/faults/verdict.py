"""Judges one faulty job from its ranks' outcomes (decent_train.faults.launch.RankOutcome).

A job passes when every judged (rank, attempt) ended in the expected error class with a message naming what went
wrong, within timeout + SLACK_S of the fault, and no process died of a signal or hung; for "exit", when every
rank exited 0 with nothing on stderr. EXPECTED says, per scenario, which ranks are judged, which attempt, the
error class and the words the message must hold, and the clock the seconds are read on.
"""

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from .scenarios import FAULTY, OPTION_CASES

SLACK_S = 5.0   # the bound: a clear error within timeout + 5 s of the fault


@dataclass
class Expect:
    attempt: str
    error: str                 # a class name in the exception's MRO
    words: List[str]           # every one must be in the message (per path: dict path -> words)
    clock: str = "fault"       # "fault": from the faulty rank's t_fault; "attempt": from the attempt's own start
    ranks: str = "live"        # "live": all but FAULTY; "all"


def _named(path, p2p, group):
    return p2p if path == "p2p" else group


def expected(scenario: str, path: str, rank: int) -> List[Expect]:
    """What `rank` must see in `scenario` on `path` (empty: nothing judged on this rank)."""
    faulty = rank == FAULTY
    if scenario in ("dead", "silent", "silent-warmup"):
        kind = "ExchangeError" if scenario == "dead" else "ExchangeTimeout"
        return [] if faulty else [Expect("train after the fault", kind, [f"rank {FAULTY}"])]
    if scenario == "late":
        words = ["this rank (rank 1) arrived after"] if faulty else ["rank 1 did not arrive"]
        return [Expect("construct", "ExchangeTimeout", words, clock="attempt")]
    if scenario == "options":
        return [Expect(name, "RuntimeError", [f"rank {FAULTY}", name], clock="attempt") for name in OPTION_CASES]
    if scenario == "size":
        return [Expect("parameter shapes", "RuntimeError", [f"rank {FAULTY}", "parameter 0"], clock="attempt"),
                Expect("bucket size", "ExchangeError", ["bucket 3", "1500 elements", "1000 elements"],
                       clock="attempt")]
    if scenario == "nan":
        if faulty:
            return [Expect("train", "RuntimeError", ["rank 1:", "after optimizer step 3", "not finite"])]
        return [Expect("train", "RuntimeError", ["non-finite", _named(path, "from rank 1", "(rank 1 sent non-finite")])]
    return []


@dataclass
class Verdict:
    tried: int = 0
    clear: int = 0
    seconds: List[float] = field(default_factory=list)   # fault -> error, per judged attempt
    signal_deaths: int = 0
    hung: int = 0
    problems: List[str] = field(default_factory=list)

    @property
    def max_s(self) -> Optional[float]:
        return max(self.seconds) if self.seconds else None

    @property
    def passed(self) -> bool:
        # tried > 0: a job with nothing judged (an unknown scenario, ranks that crashed before their first attempt
        # in a scenario expecting nothing of them) proves nothing; it passed with 0 of 0.
        return 0 < self.tried == self.clear and not self.signal_deaths and not self.hung and not self.problems


def _fault_time(outcomes) -> Optional[float]:
    times = [o.record.get("t_fault") for o in outcomes if o.record.get("t_fault") is not None]
    return min(times) if times else None


def judge(scenario: str, path: str, timeout: float, outcomes) -> Verdict:
    v = Verdict()
    for o in outcomes:
        if o.hung:
            v.hung += 1
            v.problems.append(f"rank {o.rank} still running at the deadline (killed)")
        elif o.returncode < 0:
            v.signal_deaths += 1
            v.problems.append(f"rank {o.rank} died of signal {-o.returncode}: {o.stderr.strip()[-300:]}")
    if scenario == "exit":
        return _judge_exit(v, outcomes)
    t_fault = _fault_time(outcomes)
    for o in outcomes:
        attempts = {a["what"]: a for a in o.record.get("attempts", [])}
        for exp in expected(scenario, path, o.rank):
            v.tried += 1
            a = attempts.get(exp.attempt)
            if a is None:
                v.problems.append(f"rank {o.rank}: no record of {exp.attempt!r} (exit code {o.returncode})")
                continue
            start = a["t_start"] if exp.clock == "attempt" else t_fault
            if a.get("error") is None:
                v.problems.append(f"rank {o.rank}: {exp.attempt!r} raised nothing")
                continue
            seconds = a["t_end"] - start if start is not None else float("nan")
            v.seconds.append(seconds)
            missing = [w for w in exp.words if w not in a["message"]]
            if exp.error not in a["error"] or missing:
                v.problems.append(f"rank {o.rank}: {exp.attempt!r}: {a['error'][0]} without {missing or exp.error}: "
                                  f"{a['message'][:300]}")
            elif not seconds <= timeout + SLACK_S:
                v.problems.append(f"rank {o.rank}: {exp.attempt!r} raised after {seconds:.1f} s")
            else:
                v.clear += 1
    return v


def _judge_exit(v: Verdict, outcomes) -> Verdict:
    for o in outcomes:
        v.tried += 1
        err = [line for line in o.stderr.splitlines() if line.strip()]
        trained = [a for a in o.record.get("attempts", []) if a["what"] == "train" and a.get("error") is None]
        if o.returncode == 0 and not err and trained:
            v.clear += 1
            if "t_end" in o.record:
                v.seconds.append(o.exited_at - o.record["t_end"])
        elif o.returncode is not None and o.returncode >= 0:
            v.problems.append(f"rank {o.rank}: exit code {o.returncode}, stderr: {' | '.join(err)[:400]}")
    return v


def summarize(verdicts: Dict[str, Verdict]) -> Verdict:
    """Adds up the verdicts of several jobs (the cells of one scenario)."""
    total = Verdict()
    for v in verdicts.values():
        total.tried += v.tried
        total.clear += v.clear
        total.seconds += v.seconds
        total.signal_deaths += v.signal_deaths
        total.hung += v.hung
        total.problems += v.problems
    return total
