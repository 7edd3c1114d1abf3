"""Benchmarks are not timed tests: CI only smoke-runs them with a tiny setting."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_loss_kernels_quick_runs_and_reports(tmp_path):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "loss_kernels.py"), "--quick",
                          "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    table = (tmp_path / "loss_kernels_quick.md").read_text()
    for row in ("| full | plain", "| full | chunked", "| topk100+tail | chunked"):
        assert row in table
    assert (tmp_path / "loss_kernels_quick.png").stat().st_size > 0


@pytest.mark.slow  # starts a server process (~20-60 s on the shared machine)
def test_serve_load_quick_runs_and_reports(tmp_path):
    out = tmp_path / "serve_load.json"
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--quick",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["requests"] > 0 and report["failed"] == 0 and report["feedback_lost"] == 0
    assert report["feedback_acknowledged"] > 0
    assert set(report["latency_ms"]) == {"p50", "p90", "p99"}
