"""Benchmarks are not timed tests: CI only smoke-runs them with a tiny setting."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_loss_kernels_quick_runs_and_reports(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_kernels.py"), "--quick",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    table = (tmp_path / "loss_kernels_quick.md").read_text()
    for row in ("| full | plain", "| full | chunked", "| topk100+tail | chunked"):
        assert row in table
    assert (tmp_path / "loss_kernels_quick.png").stat().st_size > 0
