"""Benchmarks are not timed tests: CI only smoke-runs them with a tiny setting (tiny random model
where a model is needed) so they cannot rot. What they measure is in benchmarks/README.md."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _call(script: str, tmp_path: Path, *args: str, timeout: int = 600
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args,
                           "--out-dir", str(tmp_path)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _run(script: str, tmp_path: Path, *args: str, timeout: int = 600) -> str:
    res = _call(script, tmp_path, *args, timeout=timeout)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_loss_kernels_quick_runs_and_reports(tmp_path):
    _run("loss_kernels.py", tmp_path, "--quick")
    table = (tmp_path / "loss_kernels_quick.md").read_text()
    for row in ("| full | plain", "| full | chunked", "| topk100+tail | chunked"):
        assert row in table
    assert (tmp_path / "loss_kernels_quick.png").stat().st_size > 0


@pytest.mark.slow
def test_vs_trl_quick_checks_the_loss_and_times_both_sides(tmp_path):
    _run("vs_trl.py", tmp_path, "--quick", "--kernel-cache-capacity", "32")
    data = json.loads((tmp_path / "vs_trl_quick_kcache32.json").read_text())
    eq = data["check"]["equal_lengths"]
    # the same function: same loss and gradients on the same batch. Tolerance: TRL's tail
    # bucket log(1 - sum top-k) loses relative precision when the top-k holds nearly all the
    # mass, as on this tiny model (on the real one they agree to 5e-7, see the README)
    assert eq["trl_loss"] == pytest.approx(eq["our_loss"], rel=1e-2)
    assert eq["grad_max_abs_diff"] <= 2e-2 * eq["grad_max_abs"]
    for side in ("ours", "trl"):
        stats = data["stats"][side]
        assert stats["step"]["n"] == 1 and stats["step"]["median"] > 0
        assert stats["rss_peak_mib"] > stats["rss_loaded_mib"] > 0
    report = (tmp_path / "vs_trl_quick_kcache32.md").read_text()
    assert "Same loss on the same batch" in report and "peak RSS" in report
    assert "kernel caches at 32 entries each" in report
    assert (tmp_path / "vs_trl_quick_kcache32.png").stat().st_size > 0


@pytest.mark.slow
def test_utilization_quick_counts_flops_and_compares_with_matmul(tmp_path):
    _run("utilization.py", tmp_path, "--quick")
    data = json.loads((tmp_path / "utilization_quick.json").read_text())
    assert data["counted_flops"] > 0 and data["seconds"] > 0 and data["matmul_flops_per_s"] > 0
    # LoRA: the honest formula is far below 6 x all params x tokens, and near what was counted
    assert data["honest_flops"] < data["six_p_n_flops"]
    assert 0.5 < data["honest_flops"] / data["counted_flops"] < 2.0
    assert "of matmul FLOP/s" in (tmp_path / "utilization_quick.md").read_text()
    assert (tmp_path / "utilization_quick.png").stat().st_size > 0


def test_fold_decoding_quick_compares_every_side(tmp_path):
    _run("fold_decoding.py", tmp_path, "--quick")
    data = json.loads((tmp_path / "fold_decoding_quick.json").read_text())
    assert {side: st["n"] for side, st in data["stats"].items()} == {
        "peft": 1, "folded": 1, "packed": 1, "hf_generate": 1}
    assert data["same_tokens"] == {"peft": 2, "folded": 2, "packed": 2, "hf_generate": 2} == {
        side: data["rows"] for side in data["stats"]}
    assert data["weights_unchanged"]
    report = (tmp_path / "fold_decoding_quick.md").read_text()
    assert "x the folded side's generation speed" in report
    assert "x HF generate's speed on the same packed weights" in report
    assert (tmp_path / "fold_decoding_quick.png").stat().st_size > 0


@pytest.mark.slow
def test_knowledge_table_quick_runs_every_arm(tmp_path):
    _run("knowledge_table.py", tmp_path, "--quick")
    table = (tmp_path / "knowledge_table_quick.md").read_text()
    for arm in ("| Base |", "| Oracle (fact in prompt) |", "| CPT |", "| SFT |",
                "| SDFT (base teacher) |", "| SDFT (EMA teacher) |",
                "| SDFT (base teacher, temperature 0.5) |"):
        assert arm in table
    assert (tmp_path / "knowledge_table_quick.png").stat().st_size > 0
    # a later seed is merged into the earlier table; the same seed again is refused up front
    first = tmp_path / "seed0.json"
    (tmp_path / "knowledge_table_quick.json").rename(first)
    _run("knowledge_table.py", tmp_path, "--quick", "--seeds", "1", "--merge", str(first))
    data = json.loads((tmp_path / "knowledge_table_quick.json").read_text())
    assert data["seeds"] == [0, 1] and data["n_seeds"] == 2
    assert all(len(runs) == 2 for runs in data["runs"].values())
    assert data["runs"]["SFT"][0] == json.loads(first.read_text())["runs"]["SFT"][0]
    assert "over 2 seed(s)" in (tmp_path / "knowledge_table_quick.md").read_text()
    again = _call("knowledge_table.py", tmp_path, "--quick", "--seeds", "0", "--merge",
                  str(first), timeout=300)
    assert again.returncode == 2 and "seeds [0] are in both" in again.stderr
    assert "Traceback" not in again.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("task", "name"), [("knowledge", "feedback_vs_scalar_quick"),
                                            ("code", "feedback_vs_scalar_code_quick")])
def test_feedback_vs_scalar_quick_has_a_curve_per_arm(tmp_path, task, name):
    _run("feedback_vs_scalar.py", tmp_path, "--quick", "--task", task)
    data = json.loads((tmp_path / f"{name}.json").read_text())
    assert set(data["curves"]) == {"sdpo", "grpo", "sdpo+grpo"}
    for runs in data["curves"].values():  # evaluated before training and after each step
        assert [g for g, _ in runs[0]] == [0, 4, 8]
    assert "GRPO's final accuracy" in (tmp_path / f"{name}.md").read_text()


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
