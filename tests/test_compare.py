"""`selfdistill compare`: runs side by side, budget mismatch flagged, bad input exits 2."""

from __future__ import annotations

import json

from selfdistill.cli import main


def _run(tmp_path, name, method, steps, train_after, gens=4):
    d = tmp_path / name
    d.mkdir()
    suite = {"train": {"accuracy": 0.25, "correct": 3, "n": 12}}
    after = {"train": {"accuracy": train_after / 12, "correct": train_after, "n": 12}}
    cfg = {"method": method, "steps": steps, "batch_size": 4, "num_generations": gens,
           "gate": {"task": "train"}}
    (d / "summary.json").write_text(json.dumps({
        "config": cfg, "before": suite, "after": after, "train_seconds": 12.0,
        "gate": {"summary": "PROMOTE" if train_after > 3 else "REJECT"}}))
    (d / "evals.jsonl").write_text("".join(json.dumps({"step": s, "suites": v}) + "\n"
                                           for s, v in ((0, suite), (steps, after))))
    return d


def test_compare_writes_table_and_plot(tmp_path, capsys):
    a = _run(tmp_path, "a", "sdpo", 30, 5)
    b = _run(tmp_path, "b", "grpo", 30, 3)
    assert main(["compare", str(a), str(b), "--out", str(tmp_path / "cmp")]) == 0
    md = (tmp_path / "cmp" / "comparison.md").read_text()
    assert "| train accuracy | 25.0 % → **41.7 %** (3→5/12) | 25.0 % → **25.0 %** (3→3/12) |" in md
    assert "| training generations | 480 | 480 |" in md and "Warning" not in md
    assert (tmp_path / "cmp" / "comparison.png").stat().st_size > 1000
    c = _run(tmp_path, "c", "grpo", 10, 3)
    assert main(["compare", str(a), str(c), "--out", str(tmp_path / "cmp2")]) == 0
    assert "not on an equal budget" in (tmp_path / "cmp2" / "comparison.md").read_text()


def test_compare_rejects_a_directory_without_summary(tmp_path, capsys):
    assert main(["compare", str(tmp_path)]) == 2
    assert "no summary.json" in capsys.readouterr().err
