"""A load_state_dict that raises once it has started writing puts the optimizer back as it was.

Everything a state_dict can be refused for is checked before anything is written (checkpointing.StateDictMixin's
_load_state_dict). What still raises after that (a device error while copying, a user's consensus schedule or
adaptive policy refusing its own saved state) came half-way through the load: opt.state emptied, the counts zeroed,
the lr the checkpoint's and the gossip schedule the optimizer's own, and the next step() silently restarted Adam on
that rank. So the write runs inside ``LoadRollback``, which keeps what it changes and puts it back on an error: the
param groups and opt.state as objects (torch's load rebinds them, changes none of the old ones) with their entries,
the flat state buffers and step counts by value, and the gossip schedule (GossipSchedule.load_snapshot).

The buffers' copy is the one real cost: the optimizer's state once more, on the host, for the length of the load
(torch.optim's own load_state_dict adopts the loaded tensors and holds nothing more). On the host, not the device:
a state_dict already on the device (map_location=device, DCP's in-place load) beside the live state and a device
copy was 3x the state there (+128 MB for 16M parameters of Adam state, where torch's load added none), enough to
make a load that fits without the copy run out of device memory. The host copy costs a device-to-host transfer of
the state per load.
"""

import torch


def _kept(t: torch.Tensor) -> torch.Tensor:
    return t.to("cpu", copy=True)


class LoadRollback:
    """``with LoadRollback(opt): <write the loaded state>``: on an exception, opt as it was when the block began (the
    exception goes on)."""

    def __init__(self, opt):
        self.opt = opt
        self.groups = opt.param_groups
        self.group_items = [dict(g) for g in self.groups]
        self.state = opt.state
        self.state_items = list(self.state.items())
        # the parameters' entries (and other code's dicts under other keys) by content: views and foreign entries
        self.entries = {id(v): dict(v) for v in self.state.values() if isinstance(v, dict)}
        self.buckets = [(b, dict(b.state), {n: _kept(t) for n, t in b.state.items()}, b.step_count,
                         _kept(b.step_count), b.published, b.published_names, b.template, b.classes, b.lanes_used)
                        for b in opt._buckets]
        self.schedule = opt._schedule.load_snapshot()

    def __enter__(self):
        return self

    @torch.no_grad()
    def __exit__(self, kind, error, traceback):
        if kind is None:
            return False
        opt = self.opt
        opt.param_groups = self.groups  # Decentralized: the wrapped optimizer's (a property)
        for g, items in zip(self.groups, self.group_items):
            g.clear()
            g.update(items)
        self.state.clear()
        for key, value in self.state_items:
            if isinstance(value, dict):
                value.clear()
                value.update(self.entries[id(value)])
            self.state[key] = value
        opt.state = self.state
        for b, named, values, count, count_value, published, published_names, template, classes, lanes in self.buckets:
            b.state.clear()
            b.state.update(named)  # the same tensors, the views in opt.state stay theirs
            for name, t in named.items():
                t.copy_(values[name])
            b.step_count = count
            count.copy_(count_value)
            b.published, b.published_names, b.template, b.classes, b.lanes_used = \
                published, published_names, template, classes, lanes
        self.schedule()
        return False
