"""Rank 0's run log: rows of metrics written as CSV and JSON after every evaluation, so a killed run keeps its
log."""

import csv
import json
import os
from dataclasses import dataclass, field
from typing import List, Optional


@dataclass
class RunLog:
    """Rows of metrics (rank 0), written as CSV and JSON after every evaluation, so a killed run keeps its log."""
    out: Optional[str]
    item_name: str
    rows: List[dict] = field(default_factory=list)

    @property
    def columns(self):
        return ["step", "train_time_s", "lr", "train_loss", "val_loss", "val_acc", "consensus_distance",
                "step_time_ms", f"{self.item_name}_per_s", "bytes_sent_mb", "topology", "disagreement"]

    def write(self, config: dict, summary: dict):
        if self.out is None:
            return
        os.makedirs(self.out, exist_ok=True)
        with open(os.path.join(self.out, "log.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=self.columns, extrasaction="ignore")
            w.writeheader()
            w.writerows(self.rows)
        with open(os.path.join(self.out, "log.json"), "w") as f:
            json.dump({"config": config, "summary": summary, "rows": self.rows}, f, indent=1)
