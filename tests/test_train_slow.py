"""A short real SDFT run on the default model: the loss falls and training accuracy rises."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfdistill.train import load_config, run_training

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.slow
def test_short_sdft_on_default_model_learns(tmp_path, default_dir):
    cfg = load_config(EXAMPLES / "knowledge.yaml", [
        f"model={default_dir}", f"output_dir={tmp_path / 'run'}", "steps=16",
        "eval.every_steps=0", "eval.oracle=false", "probe_data=null", "eval_data={}",
    ])
    summary = run_training(cfg, progress=False)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first, last = metrics[:4], metrics[-4:]
    mean = lambda ms, k: sum(m[k] for m in ms) / len(ms)  # noqa: E731
    # distill_loss: the task rows' divergence (the anchors' starts at zero and can only grow)
    assert mean(last, "distill_loss") < mean(first, "distill_loss"), (first, last)
    assert summary["after"]["train"]["accuracy"] > summary["before"]["train"]["accuracy"]
