"""The loss plot of one or several runs (PNG, matplotlib's Agg backend: no display needed)."""

import os
from typing import Dict, List


def plot_runs(runs: Dict[str, List[dict]], path: str, title: str = ""):
    """Loss vs step and vs training wall-clock time, one colour per run (validation solid with markers,
    rank 0's training loss faint)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (label, rows) in enumerate(runs.items()):
        color = f"C{i}"
        train = [r for r in rows if r.get("train_loss") is not None]
        val = [r for r in rows if r.get("val_loss") is not None]
        for ax, x in zip(axes, ("step", "train_time_s")):
            ax.plot([r[x] for r in train], [r["train_loss"] for r in train], color=color, alpha=0.3, lw=1)
            ax.plot([r[x] for r in val], [r["val_loss"] for r in val], color=color, marker="o", ms=3,
                    label=f"{label} (val)")
    axes[0].set_xlabel("step")
    axes[1].set_xlabel("training wall-clock time (s)")
    for ax in axes:
        ax.set_ylabel("loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
