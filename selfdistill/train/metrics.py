"""One metrics logger: JSONL always (`RUN/metrics.jsonl`), TensorBoard when asked."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """`log(metrics, step)` appends one JSON line `{"step": .., "time": .., **metrics}`."""

    def __init__(self, run_dir: Path, *, name: str = "metrics.jsonl",
                 enabled: bool = True) -> None:
        self.path = run_dir / name
        self.enabled = enabled

    def truncate_after(self, step: int) -> None:
        """On resume: drop lines logged after the checkpoint we resume from."""
        if not self.path.is_file():
            return
        keep = [ln for ln in self.path.read_text().splitlines()
                if ln.strip() and json.loads(ln).get("step", 0) <= step]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in metrics.items()}
        with open(self.path, "a") as fh:
            fh.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]
