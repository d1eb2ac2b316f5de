"""Sets of the training scripts' flags that code other than the scripts needs, without importing torch: a benchmark
driver (bench/cluster.py, time_to_target.py) that passes the same extra flags to every run drops the
decentralized-only ones for its all-reduce baseline, which refuses them (decent_train.flags.check_flags)."""

# The flags that only the decentralized optimizers use: (flag, dest, value when not given).
DECENTRALIZED_ONLY = (("--topology", "topology", None), ("--mode", "mode", None), ("--consensus", "consensus", None),
                      ("--local-world-size", "local_world_size", None), ("--gossip-every", "gossip_every", 1),
                      ("--warmup-steps", "warmup_steps", 0), ("--delayed-mix", "delayed_mix", False),
                      ("--int8-wire", "int8_wire", False))


def extra_flags_for(optimizer: str, argv):
    """argv for a run of --optimizer `optimizer`: as it is, except for an all-reduce run, which refuses the
    decentralized-only flags: they are left out, with their values (`--flag v` or `--flag=v`)."""
    if not optimizer.startswith("allreduce"):
        return list(argv)
    takes_value = {flag: unset is not False for flag, _, unset in DECENTRALIZED_ONLY}  # False: a switch
    out, skip = [], False
    for token in argv:
        flag = token.split("=", 1)[0]
        if skip:
            skip = False
        elif flag in takes_value:
            skip = takes_value[flag] and "=" not in token
        else:
            out.append(token)
    return out
