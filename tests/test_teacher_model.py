"""Teacher regime `model` on tiny random models: another model's weights give another loss, the
same weights give the base regime's loss, a tokenizer mismatch stops the job before training
(exit 2), the teacher gets no gradient and no optimizer state, `teacher.context=none` drops the
privileged context."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from selfdistill.cli import main
from selfdistill.data import load_rows
from selfdistill.errors import ConfigError, UserError
from selfdistill.teacher import check_tokenizers, load_teacher, make_regime
from selfdistill.teacher.model_teacher import align_vocab
from selfdistill.train import load_config
from selfdistill.train.loop import (
    PhaseTimer,
    attach_contexts,
    build_model,
    make_samples,
    make_step_context,
    score_batch,
    train_step,
    update_loss,
)
from tests.conftest import save_tiny_model

KNOWLEDGE = Path(__file__).resolve().parent.parent / "examples" / "knowledge"


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory, tokenizer):
    """Same architecture and tokenizer as `tiny_dir`, different random weights."""
    return save_tiny_model(tmp_path_factory.mktemp("other_teacher"), tokenizer, seed=1)


@pytest.fixture(scope="module")
def foreign_dir(tmp_path_factory, tokenizer):
    """A teacher whose tokenizer has one extra special token: ids no longer mean the same."""
    import copy

    d = tmp_path_factory.mktemp("foreign_teacher")
    save_tiny_model(d, tokenizer, seed=2)
    tok = copy.deepcopy(tokenizer)
    tok.add_special_tokens({"additional_special_tokens": ["<|teacher_only|>"]})
    tok.save_pretrained(d)
    return str(d)


def cfg_for(tiny_dir, tmp_path, *over):
    return load_config(None, [
        f"model={tiny_dir}", f"train_data={KNOWLEDGE / 'train.jsonl'}",
        f"output_dir={tmp_path / 'run'}", "steps=1", "batch_size=2", "max_new_tokens=6",
        "eval.max_new_tokens=4", "eval.oracle=false", "probe_data=null",
        "checkpoint_every=0", "trace_store=null", "threads=1", *over])


@pytest.fixture(scope="module")
def batch(tiny_dir, tmp_path_factory):
    """One sdft batch of rollouts from the tiny student (LoRA at init: student = base)."""
    cfg = cfg_for(tiny_dir, tmp_path_factory.mktemp("batch"))
    model, tok, _ = build_model(cfg, progress=False)
    ctx = make_step_context(cfg, model, tok, load_rows(cfg.train_data))
    samples = make_samples(cfg, ctx, [0, 1], 0, PhaseTimer())
    attach_contexts(cfg, ctx, samples, PhaseTimer())
    return cfg, model, tok, samples


def loss_with(regime, cfg, model, tok, samples) -> float:
    ctx_rows, teacher_logits, sb = score_batch(regime, model, samples, tok.pad_token_id,
                                               PhaseTimer())
    with torch.no_grad():
        loss, _ = update_loss(cfg, model, samples, sb, teacher_logits, ctx_rows, update=0)
    return loss.item()


def test_other_weights_give_another_loss_same_weights_the_base_loss(batch, tiny_dir, other_dir):
    cfg, model, tok, samples = batch
    base = loss_with(make_regime("base"), cfg, model, tok, samples)
    same = loss_with(load_teacher(tiny_dir, tok, progress=False), cfg, model, tok, samples)
    other = loss_with(load_teacher(other_dir, tok, progress=False), cfg, model, tok, samples)
    assert math.isclose(same, base, rel_tol=1e-5, abs_tol=1e-7)
    assert base > 0  # the teacher reads the privileged context: not the student's prompt
    assert abs(other - base) > 0.01 * base
    bf16 = load_teacher(other_dir, tok, dtype="bfloat16", progress=False)
    assert next(bf16.teacher.parameters()).dtype == torch.bfloat16
    assert math.isclose(loss_with(bf16, cfg, model, tok, samples), other, rel_tol=0.05)


def test_context_none_drops_the_privileged_context(tiny_dir, tmp_path):
    cfg = cfg_for(tiny_dir, tmp_path, "teacher.regime=model", f"teacher.model={tiny_dir}",
                  "teacher.context=none")
    model, tok, _ = build_model(cfg, progress=False)
    ctx = make_step_context(cfg, model, tok, load_rows(cfg.train_data))
    samples = make_samples(cfg, ctx, [0, 1], 0, PhaseTimer())
    attach_contexts(cfg, ctx, samples, PhaseTimer())
    for s in samples:
        assert s.teacher_prompt == s.prompt and s.teacher_messages == s.row.messages
        assert s.row.privileged_context not in tok.decode(s.teacher_prompt)
    # Same weights and the same prompt: the teacher is the student, the divergence is zero.
    assert loss_with(ctx.regime, cfg, model, tok, samples) == pytest.approx(0.0, abs=1e-6)


def test_teacher_gets_no_gradient_and_no_optimizer_state(tiny_dir, other_dir, tmp_path):
    cfg = cfg_for(tiny_dir, tmp_path, "teacher.regime=model", f"teacher.model={other_dir}")
    model, tok, _ = build_model(cfg, progress=False)
    ctx = make_step_context(cfg, model, tok, load_rows(cfg.train_data))
    teacher = ctx.regime.teacher
    before = {n: p.detach().clone() for n, p in teacher.named_parameters()}
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    metrics = train_step(cfg, ctx, 0)
    assert metrics["loss"] > 0
    assert all(not p.requires_grad and p.grad is None for p in teacher.parameters())
    teacher_ids = {id(p) for p in teacher.parameters()}
    optimized = [p for g in ctx.optimizer.param_groups for p in g["params"]]
    assert optimized and not teacher_ids & {id(p) for p in optimized}
    assert ctx.optimizer.state and not teacher_ids & {id(p) for p in ctx.optimizer.state}
    assert all(torch.equal(p, before[n]) for n, p in teacher.named_parameters())
    changed = [n for n, p in model.named_parameters()
               if p.requires_grad and not torch.equal(p, lora_before[n])]
    assert changed  # the student did learn
    assert not any(p is q for p in teacher.parameters() for q in model.parameters())


def test_tokenizer_mismatch_fails_before_training_with_exit_2(tiny_dir, foreign_dir, tmp_path,
                                                             capsys, monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setenv("TQDM_DISABLE", "1")  # main() sets it for --quiet; restored after
    monkeypatch.setattr("selfdistill.train.run.train_step", no_training)
    monkeypatch.setattr("selfdistill.train.run.run_suites", no_training)
    code = main(["--quiet", "train", str(KNOWLEDGE.parent / "knowledge.yaml"),
                 f"model={tiny_dir}", f"output_dir={tmp_path / 'run'}",
                 "teacher.regime=model", f"teacher.model={foreign_dir}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "does not share the student's tokenizer" in err and "Traceback" not in err
    assert "cross-tokenizer" in err and len(err.strip().splitlines()) == 1


def test_check_tokenizers_names_what_differs(tokenizer):
    import copy

    assert check_tokenizers(tokenizer, copy.deepcopy(tokenizer)) is None
    extra = copy.deepcopy(tokenizer)
    extra.add_tokens(["zzteacherword"])
    assert "vocabularies differ" in check_tokenizers(tokenizer, extra)
    eos = copy.deepcopy(tokenizer)
    eos.eos_token = "<|im_start|>"
    assert "eos_token_id" in check_tokenizers(tokenizer, eos)


def test_teacher_directory_errors_are_user_errors(tmp_path, tokenizer):
    with pytest.raises(UserError, match="no such directory"):
        load_teacher(str(tmp_path / "missing"), tokenizer, progress=False)


@pytest.mark.parametrize("over, needle", [
    (["teacher.regime=model"], "teacher.model"),
    (["teacher.model=/somewhere"], "teacher.regime=model"),
    (["teacher.context=none"], "teacher.regime=model"),
    (["teacher.regime=model", "teacher.model=x", "teacher.dtype=float16"], "teacher.dtype"),
])
def test_teacher_config_is_checked_before_loading(over, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [f"train_data={KNOWLEDGE / 'train.jsonl'}", *over])


def test_align_vocab_cuts_or_pads_with_zero_probability():
    logits = torch.randn(2, 3, 5)
    assert torch.equal(align_vocab(logits, 5), logits)
    assert torch.equal(align_vocab(logits, 4), logits[..., :4])
    wide = align_vocab(logits, 7)
    assert wide.shape == (2, 3, 7) and torch.equal(wide[..., :5], logits)
    probs = wide.softmax(-1)
    assert torch.all(probs[..., 5:] == 0) and torch.isfinite(wide.log_softmax(-1)).all()


def test_a_full_run_with_another_teacher_resumes_and_replays(tiny_dir, other_dir, tmp_path,
                                                            capsys):
    """`selfdistill train` end to end with teacher.regime=model: the checkpoint records the
    teacher's path (not its weights), and `traces replay` reloads the teacher and matches."""
    import json

    from safetensors.torch import load_file

    from selfdistill.train import run_training
    from selfdistill.train.checkpoint import latest_checkpoint, load_state

    out = tmp_path / "run"
    cfg = load_config(None, [
        f"model={tiny_dir}", f"train_data={KNOWLEDGE / 'train.jsonl'}", f"output_dir={out}",
        "steps=2", "batch_size=2", "max_new_tokens=6", "eval.max_new_tokens=4",
        "eval.oracle=false", "probe_data=null", "checkpoint_every=1", "threads=1",
        "teacher.regime=model", f"teacher.model={other_dir}", "teacher.dtype=bfloat16"])
    summary = run_training(cfg, progress=False)
    assert summary["config"]["teacher"]["model"] == other_dir
    state = load_state(latest_checkpoint(out))["regime"]
    assert state == {"name": "model", "path": other_dir}
    saved = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert saved and all("lora_" in k for k in saved)  # the adapter only, no teacher weights
    assert main(["traces", "replay", str(out), "--step", "2"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["match"] is True, result
