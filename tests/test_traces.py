"""The trainer's trace recording and `traces replay` on a tiny random model: complete traces of an
sdft run, replayed losses that match, feedback of an sdpo run, resume without duplicates, and the
code SDPO example (1 step) with its test-based evaluation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from selfdistill.cli import main
from selfdistill.errors import UserError
from selfdistill.store import TraceStore, sha256_file
from selfdistill.train import load_config, run_training
from selfdistill.train.replay import replay_step

ROOT = Path(__file__).resolve().parent.parent
KNOWLEDGE = ROOT / "examples" / "knowledge"
EXAMPLES = ROOT / "examples"


def tiny_cfg(tiny_dir, out, *over, config=None):
    base = [f"model={tiny_dir}", f"output_dir={out}", "max_new_tokens=6",
            "eval.max_new_tokens=4", "eval.oracle=false", "probe_data=null", "threads=1"]
    if config is None:
        base.append(f"train_data={KNOWLEDGE / 'train.jsonl'}")
    return load_config(config, [*base, *over])


def read_store(run_dir, url=None):
    with TraceStore(url) if url else TraceStore(path=run_dir) as store:
        [run] = store.runs()
        steps = store.steps(run["id"])
        attempts = []
        store.export_jsonl(run["id"], run_dir / "export.jsonl")
        for line in (run_dir / "export.jsonl").read_text().splitlines():
            attempts.append(json.loads(line))
        return run, steps, attempts


@pytest.fixture(scope="module")
def sdft_run(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("sdft") / "run"
    cfg = tiny_cfg(tiny_dir, out, "method=sdft", "steps=3", "batch_size=2",
                   "num_generations=2", "checkpoint_every=1", "teacher.regime=ema",
                   "teacher.rate=0.5")
    run_training(cfg, progress=False)
    return out


def test_sdft_run_writes_complete_traces(sdft_run):
    run, steps, attempts = read_store(sdft_run)
    assert run["name"] == "run" and run["status"] == "finished" and run["scope"] == "global"
    assert run["config"]["method"] == "sdft"
    assert (sdft_run / "run_id").read_text().strip() == run["id"]
    assert len(attempts) == 3 * 2 * 2
    contexts = {r["privileged_context"] for r in map(json.loads, (
        KNOWLEDGE / "train.jsonl").read_text().splitlines())}
    for a in attempts:
        [tc] = a["teacher_contexts"]
        assert tc["kinds"] == ["fact"]  # the example rows carry context_kind "fact"
        last = tc["messages"][-1]["content"]
        assert any(c in last for c in contexts), last
        assert a["prompt"][-1]["content"] in last  # the request itself is kept
        assert a["completion_ids"] and a["step"] in (1, 2, 3)
        [used] = a["consumed_by"]
        assert used["step"] == a["step"] and used["token_credit"]["n"] == len(a["completion_ids"])
    groups = {a["group_id"] for a in attempts}
    assert len(groups) == 3 * 2  # unique per (step, group)

    logged = [json.loads(x) for x in (sdft_run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert [s["loss"] for s in steps] == [m["loss"] for m in logged]
    assert all(len(s["attempt_ids"]) == 4 for s in steps)
    ckpts = sorted((sdft_run / "checkpoints").glob("step_*"))
    assert steps[0]["checkpoint_before"] == "base"
    assert [s["checkpoint_after"] for s in steps] == [str(c.resolve()) for c in ckpts]
    assert steps[1]["checkpoint_before"] == str(ckpts[0].resolve())
    assert steps[2]["checkpoint_before"] == str(ckpts[1].resolve())
    with TraceStore(path=sdft_run) as store:
        batch = store.step_batch(run["id"], 3)
    ck = batch["checkpoint_before"]
    assert ck["step"] == 2
    assert ck["weights_sha256"] == sha256_file(
        Path(ck["path"]) / "weights" / "adapter_model.safetensors")


@pytest.mark.parametrize("step", [1, 2, 3])
def test_replay_matches_logged_loss(sdft_run, step, capsys):
    assert main(["traces", "replay", str(sdft_run), "--step", str(step)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == step and result["match"] is True, result
    assert result["abs_diff"] <= 1e-4 * abs(result["logged_loss"])
    assert result["logged_loss"] > 0


def test_replay_with_anchors_and_bfloat16_matches(tiny_dir, tmp_path, capsys):
    """Anchor rows are a separate token mean (anchor_weight): replay must know which rows were
    anchors (recorded as teacher-context kind "anchor") and run in the run's precision."""
    out = tmp_path / "run"
    cfg = tiny_cfg(tiny_dir, out, "steps=2", "batch_size=2", "checkpoint_every=1",
                   "anchor_data=builtin", "anchor_batch_size=2", "loss.anchor_weight=3",
                   "precision=bfloat16")
    run_training(cfg, progress=False)
    _, _, attempts = read_store(out)
    kinds = [a["teacher_contexts"][0]["kinds"] for a in attempts]
    assert kinds.count(["anchor"]) == 4 and kinds.count(["fact"]) == 4
    assert main(["traces", "replay", str(out), "--step", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["match"] is True, result


def test_replay_without_the_runs_data_says_it_ran_without_the_prompt_cache(tiny_dir, tmp_path,
                                                                           capsys):
    """The frozen teacher's prompt cache is rebuilt from the run's training rows; when that file
    is gone, replay still runs (plain teacher forward, float32 here: within tolerance) and its
    result says why rounding may differ."""
    data = tmp_path / "train.jsonl"
    shutil.copy(KNOWLEDGE / "train.jsonl", data)
    out = tmp_path / "run"
    run_training(tiny_cfg(tiny_dir, out, "steps=2", "batch_size=2", "checkpoint_every=1",
                          f"train_data={data}"), progress=False)
    assert main(["traces", "replay", str(out), "--step", "2"]) == 0
    assert "note" not in json.loads(capsys.readouterr().out)
    data.unlink()
    assert main(["traces", "replay", str(out), "--step", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["match"] is True, result
    assert "could not be read" in result["note"] and "prompt cache" in result["note"]


def test_export_gives_one_line_per_attempt(sdft_run, tmp_path):
    out = tmp_path / "e.jsonl"
    assert main(["traces", "export", str(sdft_run), "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3 * 2 * 2


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("qa") / "qa.jsonl"
    # An answer no tiny random model produces: every attempt fails and gets feedback.
    rows = [{"prompt": f"Say the word number {i}.", "answer": ["Zyqxwv"]} for i in range(4)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_sdpo_records_feedback_and_unreplayable_step_fails_clearly(tiny_dir, qa_file,
                                                                    tmp_path):
    out = tmp_path / "sdpo"
    cfg = tiny_cfg(tiny_dir, out, "method=sdpo", f"train_data={qa_file}", "steps=2",
                   "batch_size=2", "num_generations=2", "checkpoint_every=0")
    run_training(cfg, progress=False)
    run, steps, attempts = read_store(out)
    assert len(attempts) == 2 * 2 * 2
    assert [(s['step'], s['checkpoint_before']) for s in steps] == [(1, 'base'), (2, 'base')]
    for a in attempts:
        [fb] = a["feedback"]
        assert fb["kind"] == "ground_truth" and fb["reward"] == 0.0 and fb["passed"] is False
        assert fb["credit_scope"] == "rollout" and "Zyqxwv" in fb["text"]
        [tc] = a["teacher_contexts"]
        assert tc["kinds"] == ["feedback"] and tc["feedback_ids"] == [fb["id"]]
        assert "Zyqxwv" in tc["messages"][-1]["content"]
    with TraceStore(path=out) as store:
        assert replay_step(store, run["id"], 1)["match"]
        with pytest.raises(UserError, match=r"Replayable steps: \[1\].*checkpoint_every=1"):
            replay_step(store, run["id"], 2)
        with pytest.raises(UserError, match="no training step 7"):
            replay_step(store, run["id"], 7)


def test_resumed_run_records_each_step_once(tiny_dir, tmp_path):
    out, url = tmp_path / "resume", f"sqlite:///{tmp_path / 'shared.db'}"  # a store by URL
    over = ["method=sdft", "steps=2", "batch_size=1", "checkpoint_every=1", f"trace_store={url}"]
    run_training(tiny_cfg(tiny_dir, out, *over), progress=False)
    cfg = load_config(out / "config.yaml", ["steps=4", f"output_dir={out}"])
    run_training(cfg, resume=True, progress=False)
    run, steps, attempts = read_store(out, url)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert sorted(a["step"] for a in attempts) == [1, 2, 3, 4]
    assert run["status"] == "finished" and run["config"]["steps"] == 4
    assert not (out / "traces.db").exists()
    # The run directory names its store (config.yaml) and run (run_id) for the CLI.
    assert main(["traces", "export", str(out), "--out", str(tmp_path / "e.jsonl")]) == 0
    assert len((tmp_path / "e.jsonl").read_text().splitlines()) == 4
    with TraceStore(url) as store:
        assert sorted(store.step_batch(run["id"], s)["checkpoint_before"]["step"]
                      for s in (2, 3, 4)) == [1, 2, 3]
        assert replay_step(store, run["id"], 3)["match"]  # from the checkpoint resumed from


def test_failing_test_gets_an_artifact_record():
    from selfdistill.data import load_rows
    from selfdistill.envs import make_env
    from selfdistill.train.traces import feedback_records

    row = load_rows(EXAMPLES / "code_problems.jsonl")[0]  # sum_evens
    fb = make_env(row).step("```python\ndef sum_evens(nums):\n    return 0\n```")
    rollout, artifact = feedback_records("a1", fb, row.extra["tests"])
    assert rollout["credit_scope"] == "rollout" and rollout["kind"] == "test_failure"
    assert artifact["credit_scope"] == "artifact" and artifact["artifact"] == "tests[0]"
    assert artifact["evidence"]["test"] == row.extra["tests"][0]
    syntax = make_env(row).step("```python\ndef sum_evens(:\n```")
    assert len(feedback_records("a2", syntax, row.extra["tests"])) == 1  # whole program


def test_code_sdpo_example_one_step(tiny_dir, tmp_path):
    out = tmp_path / "code"
    cfg = tiny_cfg(tiny_dir, out, "steps=1", "batch_size=2", "num_generations=2",
                   config=EXAMPLES / "code_sdpo.yaml")
    assert cfg.method == "sdpo" and cfg.max_new_tokens == 6
    summary = run_training(cfg, progress=False)
    assert summary["before"]["train"]["n"] == 12  # the problems' pass rate, by their tests
    assert json.loads((out / "eval_after.json").read_text())["train"]["n"] == 12
    _, steps, attempts = read_store(out)
    assert len(attempts) == 4 and len(steps) == 1
    references = [json.loads(x)["reference"]
                  for x in (EXAMPLES / "code_problems.jsonl").read_text().splitlines()]
    for a in attempts:
        fb = a["feedback"][0]
        assert fb["evidence"]["tests_total"] >= 1 and 0.0 <= fb["reward"] <= 1.0
        shown = json.dumps([a["prompt"], [t["messages"] for t in a["teacher_contexts"]]])
        assert not any(ref.strip() in shown or json.dumps(ref)[1:-1] in shown
                       for ref in references)
    grpo = load_config(EXAMPLES / "code_grpo.yaml")
    assert grpo.method == "grpo" and grpo.num_generations == 4 and grpo.batch_size == 4


def test_replay_notices_a_changed_batch_or_teacher(sdft_run, tmp_path, monkeypatch, capsys):
    import shutil

    from sqlalchemy import update

    from selfdistill.store.models import TeacherContext
    from selfdistill.teacher import EmaRegime

    # Without the EMA state from state.pt the teacher is the live model: a different loss.
    monkeypatch.setattr(EmaRegime, "load_state_dict", lambda self, state: None)
    with TraceStore(path=sdft_run) as store:
        assert not replay_step(store, store.runs()[0]["id"], 3)["match"]
    monkeypatch.undo()
    # A teacher context edited in the store changes the replayed loss: exit code 1.
    copy = tmp_path / "run"
    shutil.copytree(sdft_run, copy)
    with TraceStore(path=copy) as store, store.session() as session, session.begin():
        session.execute(update(TeacherContext).values(
            messages=[{"role": "user", "content": "Something else entirely."}]))
    assert main(["traces", "replay", str(copy), "--step", "2"]) == 1
    assert json.loads(capsys.readouterr().out)["match"] is False
