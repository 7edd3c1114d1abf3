"""The training loop on a tiny random model: every method, masks, no-context samples, resume
after SIGKILL, config validation. (The real default model: tests/test_train_slow.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from selfdistill.errors import ConfigError, DataError
from selfdistill.train import load_config, run_training
from selfdistill.train.loop import batch_indices

KNOWLEDGE = Path(__file__).resolve().parent.parent / "examples" / "knowledge"


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("qa")
    p = d / "qa.jsonl"
    # An answer no tiny random model produces: every attempt fails and gets feedback.
    rows = [{"prompt": f"Say the word number {i}.", "answer": ["Zyqxwv"],
             "privileged_context": "Answer: Zyqxwv."} for i in range(4)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def tiny_cfg(tiny_dir, out, **over):
    base = [f"model={tiny_dir}", f"train_data={KNOWLEDGE / 'train.jsonl'}", f"output_dir={out}",
            "steps=2", "batch_size=2", "max_new_tokens=6", "eval.max_new_tokens=4",
            "eval.oracle=false", "probe_data=null", "checkpoint_every=0", "threads=1"]
    return load_config(None, base + [f"{k}={v}" for k, v in over.items()])


def adapter_weights(run_dir):
    return load_file(str(Path(run_dir) / "adapter" / "adapter_model.safetensors"))


@pytest.mark.parametrize("method, extra", [
    ("sdft", {}),
    ("sft", {}),
    ("cpt", {}),
    ("sdpo", {"num_generations": 2, "train_data": "{qa}"}),
    ("grpo", {"num_generations": 2, "train_data": "{qa}"}),
    ("grpo", {"num_generations": 2, "train_data": "{qa}", "anchor_data": "builtin",
              "anchor_batch_size": 2}),
    ("sdft", {"anchor_data": "builtin", "anchor_batch_size": 3}),
    ("sdft", {"loss.estimator": "topk", "loss.topk": 5, "teacher.regime": "ema"}),
    ("sdft", {"loss.estimator": "sampled", "loss.alpha": 1, "teacher.regime": "trust_region"}),
])
def test_one_step_of_each_method_changes_only_the_adapter(tiny_dir, qa_file, tmp_path,
                                                          monkeypatch, method, extra):
    extra = {k: (v.replace("{qa}", qa_file) if isinstance(v, str) else v)
             for k, v in extra.items()}
    cfg = tiny_cfg(tiny_dir, tmp_path / "run", method=method, steps=1, **extra)
    if method == "grpo":  # a group needs different rewards for a non-zero advantage
        import selfdistill.envs as envs
        from selfdistill.envs.base import Feedback

        calls = iter(range(1000))

        class Alternating:
            def step(self, text):
                r = float(next(calls) % 2)
                return Feedback(reward=r, text="", kind="ground_truth", passed=bool(r),
                                evidence={})

        monkeypatch.setattr(envs, "make_env", lambda row, **kw: Alternating())
    summary = run_training(cfg, progress=False)
    weights = adapter_weights(tmp_path / "run")
    lora_b = [v for k, v in weights.items() if "lora_B" in k]
    assert lora_b, "no LoRA weights saved"
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    if metrics[0]["skipped_update"]:
        pytest.fail(f"{method}: the step had no training signal: {metrics[0]}")
    # PEFT initializes B to zero: any non-zero B means the optimizer updated the adapter.
    assert any(b.abs().sum() > 0 for b in lora_b)
    # Base weights were frozen: the base model file is untouched and the adapter holds only LoRA.
    assert all("lora_" in k for k in weights)
    assert summary["gate"]["checks"][0]["name"] == "task:train"
    for name in ("report.md", "plot.png", "summary.json", "config.yaml"):
        assert (tmp_path / "run" / name).is_file()


def test_batch_indices_cover_each_epoch_once():
    seen = [i for s in range(4) for i in batch_indices(s, 16, 4, seed=3)]
    assert sorted(seen) == list(range(16))
    assert batch_indices(5, 16, 4, seed=3) == batch_indices(5, 16, 4, seed=3)
    assert batch_indices(0, 16, 4, seed=3) != batch_indices(0, 16, 4, seed=4)


def test_no_context_samples_get_no_distillation_loss():
    from selfdistill.train.config import LossConfig
    from selfdistill.train.methods import LossInputs, Sample, method_loss

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, requires_grad=True)
    ids = torch.randint(0, 11, (2, 3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    samples = [Sample(i, None, 0, [1], ids[i].tolist()) for i in range(2)]
    x = LossInputs(logits, ids, mask, None, torch.zeros(0, dtype=torch.long))
    loss, metrics = method_loss("sdft", samples, x, LossConfig(), update=0, group_size=1)
    loss.backward()
    assert loss.item() == 0.0 and metrics["distill_loss"] == 0.0
    assert torch.count_nonzero(logits.grad) == 0
    # Only the row with context contributes: its loss equals the loss of that row alone.
    teacher = torch.randn(1, 3, 11)
    x1 = LossInputs(logits, ids, mask, teacher, torch.tensor([1]))
    loss1, _ = method_loss("sdft", samples, x1, LossConfig(alpha=0.0), update=0, group_size=1)
    from selfdistill.losses import per_token_divergence

    ref = per_token_divergence(logits[1:], teacher, alpha=0.0).mean()
    assert torch.allclose(loss1, ref)


@pytest.mark.parametrize("environment_feedback", [True, False])
def test_sdpo_contexts_siblings_and_feedback(environment_feedback):
    """A failed attempt gets a successful sibling's text (first) and its own feedback; a success
    gets nothing (not its own solution); without environment feedback only siblings teach."""
    from selfdistill.envs.base import Feedback
    from selfdistill.train.methods import Sample, sdpo_contexts

    def attempt(i: int, reward: float) -> Sample:
        fb = Feedback(reward, f"why {i}", "wrong_answer", reward == 1.0)
        return Sample(i, None, 0, [1], [2], text=f"code {i}", reward=reward, feedback=fb)

    win, lose = attempt(0, 1.0), attempt(1, 0.5)
    sdpo_contexts([win, lose], success_threshold=1.0, sibling_solutions=True, include_self=False,
                  feedback_for_successes=False, environment_feedback=environment_feedback)
    assert win.contexts == []
    want = [("solution", "code 0")] + [("feedback", "why 1")] * environment_feedback
    assert [(c.kind, c.text) for c in lose.contexts] == want
    alone = attempt(2, 0.0)  # no successful sibling: feedback or nothing
    sdpo_contexts([alone], success_threshold=1.0, sibling_solutions=True, include_self=False,
                  feedback_for_successes=False, environment_feedback=environment_feedback)
    got = [(c.kind, c.text) for c in alone.contexts]
    assert got == [("feedback", "why 2")] * environment_feedback


def test_anchor_teacher_sees_the_student_prompt_and_starts_at_zero_divergence(
        tiny_dir, tmp_path, monkeypatch):
    """Anchors are distilled toward the teacher WITHOUT context: at the first update (LoRA B = 0,
    regime base) student and teacher are the same function, so their divergence is zero, while
    the task rows (fact in the teacher's prompt) diverge."""
    import selfdistill.train.loop as loop

    seen = []
    real = loop.score_batch

    def spy(regime, model, samples, pad, timer, **kw):
        seen.extend(samples)
        return real(regime, model, samples, pad, timer, **kw)

    monkeypatch.setattr(loop, "score_batch", spy)
    cfg = tiny_cfg(tiny_dir, tmp_path / "run", steps=1, batch_size=2, anchor_data="builtin",
                   anchor_batch_size=3)
    run_training(cfg, progress=False)
    anchors = [s for s in seen if s.anchor]
    assert len(anchors) == 3 and len(seen) == 5
    assert all(s.teacher_prompt == s.prompt and not s.contexts for s in anchors)
    assert all(s.teacher_prompt != s.prompt for s in seen if not s.anchor)
    m = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert m["anchor_samples"] == 3 and m["no_context"] == 0
    assert abs(m["anchor_distill_loss"]) < 1e-5 < m["distill_loss"]


def test_base_anchors_are_the_initial_weights_samples_drawn_once(tiny_dir, tmp_path,
                                                                  monkeypatch):
    """anchor_source=base: each anchor prompt's completion comes from the adapter-off model,
    seeded by the anchor's index, drawn the first time it is needed and reused afterwards."""
    import selfdistill.train.loop as loop
    from selfdistill.chat import prompt_ids
    from selfdistill.rollout.hf import generate
    from selfdistill.rollout.seeding import BASE_ANCHOR_STREAM, sample_seed

    seen = []
    real = loop.score_batch

    def spy(regime, model, samples, pad, timer, **kw):
        seen.append([s for s in samples if s.anchor])
        return real(regime, model, samples, pad, timer, **kw)

    monkeypatch.setattr(loop, "score_batch", spy)
    cfg = tiny_cfg(tiny_dir, tmp_path / "run", steps=3, anchor_data="builtin",
                   anchor_batch_size=40, anchor_source="base", learning_rate=0.05)
    run_training(cfg, progress=False)
    first = {s.row_index: s.completion for s in seen[0]}
    later = {s.row_index: s.completion for step in seen[1:] for s in step}
    assert first.keys() & later.keys()  # anchors met again (55 of them, 40 per step)
    assert all(later[i] == first[i] for i in first.keys() & later.keys())
    assert all(s.behaviour_logprobs is None for step in seen for s in step)
    # They are the base model's samples: regenerate one with the adapter-free model.
    from selfdistill.models import load_model

    lm = load_model(tiny_dir, progress=False)
    s = seen[0][0]
    want = generate(lm.model, lm.tokenizer, [prompt_ids(lm.tokenizer, s.row.messages)],
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                    seeds=[sample_seed(cfg.seed, 0, BASE_ANCHOR_STREAM, s.row_index)])
    assert want[0][0].token_ids == s.completion
    weights = adapter_weights(tmp_path / "run")
    assert any(float(w.abs().max()) > 0 for k, w in weights.items() if "lora_B" in k)


def test_base_anchor_draws_do_not_depend_on_which_anchors_a_step_needs(tiny_dir, tmp_path,
                                                                       monkeypatch):
    """A resumed run draws the base anchors again: the tokens must not depend on which anchors
    the first step needed, nor on the run's batch settings (padding changes float rounding)."""
    import selfdistill.train.loop as loop

    draws = []
    real_draw = loop.base_anchor_completions

    def record(cfg, ctx, indices):
        out = real_draw(cfg, ctx, indices)
        draws.append(dict(ctx.base_anchors))
        return out

    monkeypatch.setattr(loop, "base_anchor_completions", record)
    for name, size in (("a", 3), ("b", 40)):
        cfg = tiny_cfg(tiny_dir, tmp_path / name, steps=1, anchor_data="builtin",
                       anchor_batch_size=size, anchor_source="base", seed=1)
        run_training(cfg, progress=False)
    first, second = draws
    assert len(first) == len(second) == 55  # every anchor, drawn at the first call
    assert all(first[i].token_ids == second[i].token_ids for i in first)


def test_prompt_and_padding_are_masked(tokenizer):
    from selfdistill.teacher import build_batch

    b = build_batch([[5, 6, 7], [8]], [[1, 2], [3, 4, 9]], tokenizer.pad_token_id)
    assert b.completion_mask.tolist() == [[True, True, False], [True, True, True]]
    assert b.completion_ids[0, :2].tolist() == [1, 2]


@pytest.mark.parametrize("overrides, needle", [
    (["learning_rat=0.1"], "learning_rat: unknown key"),
    (["steps=many"], "steps: Input should be a valid integer"),
    (["method=dpo"], "method: Input should be"),
    (["teacher.regime=frozen"], "teacher.regime"),
    (["loss.estimator=exact"], "loss.estimator"),
    (["loss.estimator=sampled", "loss.alpha=0.5"], "reverse KL only"),
    (["method=grpo"], "num_generations >= 2"),
    (["nonsense"], "expected key=value"),
    (["anchor_batch_size=4"], "needs anchor_data"),
    (["anchor_batch_size=4", "anchor_data=builtin", "teacher.regime=live"], "IS the student"),
    (["anchor_batch_size=4", "anchor_data=builtin", "method=sft"], "makes none"),
    (["anchor_batch_size=4", "anchor_data=builtin", "anchor_source=base", "lora.enabled=false"],
     "needs lora.enabled"),
])
def test_bad_config_fails_before_loading(overrides, needle, tmp_path):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_config(None, [f"train_data={KNOWLEDGE / 'train.jsonl'}", *overrides])


def test_missing_column_for_method_fails_before_model(tmp_path, monkeypatch):
    import selfdistill.train.loop as loop

    def boom(*a, **k):
        raise AssertionError("model loaded before data validation")

    monkeypatch.setattr(loop, "build_model", boom)
    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"prompt": "q", "answer": "a"}) + "\n")
    cfg = load_config(None, [f"train_data={data}", "method=sdft", f"output_dir={tmp_path}/r"])
    with pytest.raises(DataError, match="missing 'privileged_context'"):
        run_training(cfg, progress=False)


def _train_cmd(tiny_dir, out, *extra):
    return [sys.executable, "-m", "selfdistill", "--quiet", "train",
            str(KNOWLEDGE.parent / "knowledge.yaml"), f"model={tiny_dir}", f"output_dir={out}",
            "steps=6", "batch_size=2", "max_new_tokens=6", "eval.max_new_tokens=4",
            "eval.every_steps=0", "eval.oracle=false", "probe_data=null", "checkpoint_every=2",
            "threads=1", *extra]


def test_resume_after_sigkill_equals_uninterrupted(tiny_dir, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    full = tmp_path / "full"
    subprocess.run(_train_cmd(tiny_dir, full), check=True, env=env, capture_output=True)

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_train_cmd(tiny_dir, killed), env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    index = killed / "checkpoints" / "index.jsonl"
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if index.is_file() and '"step": 2' in index.read_text():
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "adapter").exists(), "run finished before it could be killed"
    res = subprocess.run([sys.executable, "-m", "selfdistill", "--quiet", "train",
                          "--resume", str(killed)], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    a, b = adapter_weights(full), adapter_weights(killed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    steps = [json.loads(x)["step"] for x in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_existing_run_dir_is_not_overwritten(tiny_dir, tmp_path):
    from selfdistill.errors import UserError

    cfg = tiny_cfg(tiny_dir, tmp_path / "run", steps=1)
    run_training(cfg, progress=False)
    with pytest.raises(UserError, match="--resume"):
        run_training(cfg, progress=False)


def test_training_run_proposes_its_adapter_to_the_registry(tiny_dir, tmp_path):
    from selfdistill.registry import Registry

    reg_path = tmp_path / "reg" / "registry.db"
    cfg = tiny_cfg(tiny_dir, tmp_path / "run", steps=1, registry=str(reg_path),
                   scope="user:alice")
    summary = run_training(cfg, progress=False)
    version = summary["proposed_version"]
    listed = Registry(reg_path).list("user:alice")
    assert [v["id"] for v in listed] == [version["id"]]
    assert Registry(reg_path).resolve(user="alice").version is None  # proposed, not promoted


def test_builtin_anchors_are_disjoint_from_the_probes():
    """Anchors are trained on; probes measure forgetting: a shared question would make the
    probe measure the anchor's training instead."""
    from selfdistill.data import load_rows
    from selfdistill.train.run import BUILTIN_ANCHORS, BUILTIN_PROBES

    def norm(rows):
        return {r.messages[-1]["content"].strip().lower() for r in rows}

    anchors = norm(load_rows(BUILTIN_ANCHORS, require=("prompt",), purpose="anchor"))
    probes = norm(load_rows(BUILTIN_PROBES, require=("prompt", "answer"), purpose="probe"))
    assert len(anchors) >= 40 and not anchors & probes


@pytest.mark.parametrize("estimator", ["full", "sampled"])
def test_teacher_rows_line_up_when_the_longest_completion_has_no_context(tiny_model, estimator):
    """SDPO: a successful attempt (no teacher context) may be the longest completion of the batch.
    The teacher's logits must still have the student batch's width, position by position."""
    from selfdistill.teacher import make_regime
    from selfdistill.train.config import LossConfig
    from selfdistill.train.loop import PhaseTimer, score_batch
    from selfdistill.train.methods import LossInputs, Sample, method_loss

    model = tiny_model
    prompt = [5, 6, 7]
    short = Sample(0, None, 0, prompt, [11, 12], reward=0.0)
    long = Sample(1, None, 0, prompt, [13, 14, 15, 16, 17], reward=1.0)  # a success: no context
    short.teacher_prompt = [5, 6, 7, 8, 9]
    ctx_rows, t_logits, sb = score_batch(make_regime("live"), model, [short, long], 0,
                                         PhaseTimer())
    assert ctx_rows == [0] and t_logits.shape[:2] == (1, 5)
    assert sb.completion_ids.shape == (2, 5)
    with torch.no_grad():  # the aligned positions are the teacher's real predictions
        ref = model(input_ids=torch.tensor([short.teacher_prompt + short.completion])).logits
    torch.testing.assert_close(t_logits[0, :2], ref[0, 4:6], rtol=1e-4, atol=1e-4)
    logits = model(input_ids=sb.input_ids, attention_mask=sb.attention_mask,
                   position_ids=sb.position_ids).logits[:, -6:-1].float()
    x = LossInputs(logits, sb.completion_ids, sb.completion_mask, t_logits, torch.tensor([0]))
    loss, _ = method_loss("sdpo", [short, long], x, LossConfig(estimator=estimator), update=0,
                          group_size=2)
    assert torch.isfinite(loss) and loss.item() != 0.0


def test_teacher_rows_in_length_groups_come_back_in_row_order(tiny_model):
    """Task rows (long teacher prompts) and anchors (the student's short prompt) run in
    separate teacher forwards, prefix shared; each row's logits are its own, in row order."""
    from selfdistill.teacher import make_regime
    from selfdistill.train.loop import PhaseTimer, score_batch
    from selfdistill.train.methods import Sample

    system = list(range(30, 50))  # a shared system prompt
    samples = []
    for i in range(6):
        anchor = i % 2 == 1
        s = Sample(i, None, i, [*system, 60 + i], [70 + i, 71 + i][: 1 + i % 2], anchor=anchor)
        s.teacher_prompt = s.prompt if anchor else [*system, 60 + i, *list(range(80, 80 + 40))]
        samples.append(s)
    timer = PhaseTimer()
    ctx_rows, t_logits, sb = score_batch(make_regime("live"), tiny_model, samples, 0, timer,
                                         share_prefix=True)
    assert ctx_rows == list(range(6)) and sb.prefix_width == len(system)
    for j, s in enumerate(samples):
        with torch.no_grad():
            ref = tiny_model(input_ids=torch.tensor([s.teacher_prompt + s.completion])).logits[0]
        n, p = len(s.completion), len(s.teacher_prompt)
        torch.testing.assert_close(t_logits[j, :n], ref[p - 1:p - 1 + n], rtol=1e-4, atol=1e-4)


def test_a_frozen_teachers_cached_prompts_give_the_same_logits(tiny_model):
    """Base regime: the teacher prompts known before training are prefilled once (`warm`); a
    step then runs those rows over their completions only — with the full forward's logits —
    and any other row (not warmed, or over the memory budget) in full."""
    from selfdistill.models import attach_lora
    from selfdistill.teacher import PromptCache, make_regime
    from selfdistill.train.loop import PhaseTimer, score_batch
    from selfdistill.train.methods import Sample

    model = attach_lora(tiny_model, rank=4)
    with torch.no_grad():  # the adapter must matter, so that "base" is a real choice
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)

    def batch(offset):
        out = []
        for i in range(5):
            s = Sample(i, None, i, [30, 31, 40 + i],
                       [70 + i, 71, 72 + offset][: 1 + (i + offset) % 3])
            s.teacher_prompt = s.prompt if i % 2 else [30, 31, 40 + i] + [90] * (3 + 4 * i)
            out.append(s)
        return out

    regime = make_regime("base")
    warmed = [s.teacher_prompt for s in batch(0)[:4]]  # row 4's prompt is not known up front
    full, small = PromptCache(2**20), PromptCache(2**20)
    full.warm(regime, model, warmed, 0, batch_size=3)
    small.max_bytes = full.bytes // 2
    small.warm(regime, model, warmed, 0, batch_size=1)
    distinct = len({tuple(p[:-1]) for p in warmed})  # the two anchors' share theirs
    assert len(full.entries) == distinct and 0 < len(small.entries) < distinct
    assert batch(0)[4].teacher_prompt not in full
    for offset in range(2):
        samples = batch(offset)
        _, want, _ = score_batch(regime, model, samples, 0, PhaseTimer(), share_prefix=True)
        mask = torch.zeros(want.shape[:2], dtype=torch.bool)
        for j, s in enumerate(samples):
            mask[j, :len(s.completion)] = True
        for cache in (full, small):
            _, got, _ = score_batch(regime, model, samples, 0, PhaseTimer(), prompt_cache=cache)
            torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)
    # Deterministic: warming again (as a resumed run does) gives the same bits.
    again = PromptCache(2**20)
    again.warm(regime, model, warmed, 0, batch_size=3)
    for key, entry in full.entries.items():
        for (k1, v1), (k2, v2) in zip(entry, again.entries[key], strict=True):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_precision_auto_uses_bf16_only_where_the_hardware_has_it(monkeypatch):
    """Emulated bf16 autocast on an AVX2-only CPU made a step ~50x slower than float32, so
    `auto` (the examples' setting) must fall back to float32 there; explicit values stand."""
    import selfdistill.train.loop as loop

    cpu = torch.device("cpu")
    for native, want in ((False, "float32"), (True, "bfloat16")):
        monkeypatch.setattr(loop, "native_bf16", lambda device, n=native: n)
        assert loop.resolve_precision("auto", cpu) == want
        assert loop.resolve_precision("float32", cpu) == "float32"
        assert loop.resolve_precision("bfloat16", cpu) == "bfloat16"
        cfg = SimpleNamespace(precision="auto")
        model = torch.nn.Linear(2, 2)
        with loop.precision(cfg, model):
            assert torch.is_autocast_enabled("cpu") == (want == "bfloat16")


def test_frozen_weights_are_rounded_once_only_where_it_costs_no_memory_asked_to_be_saved():
    """A step stores the frozen weights in autocast's dtype under bf16, not under float32, not
    with gradient checkpointing (the memory option) and not under a sharding engine."""
    import selfdistill.train.loop as loop

    model = torch.nn.Linear(2, 2)
    one, sharded = SimpleNamespace(sharded=False), SimpleNamespace(sharded=True)
    for precision, ckpt, dist, want in (("bfloat16", False, one, torch.bfloat16),
                                        ("float32", False, one, None),
                                        ("bfloat16", True, one, None),
                                        ("bfloat16", False, sharded, None)):
        cfg = SimpleNamespace(precision=precision, gradient_checkpointing=ckpt)
        assert loop.frozen_weight_dtype(cfg, model, dist) == want


@pytest.mark.parametrize("checkpointing", [False, True])
def test_frozen_weights_rounded_once_give_autocasts_result(checkpointing):
    """Under bf16 autocast, a step's teacher and student passes run with the frozen linear
    weights stored in bf16 (`frozen_weights_in`): autocast would round them to the same values
    at every forward, so the loss and the LoRA gradients are bit-identical — also when
    gradient checkpointing recomputes the forward during the backward. Afterwards every module
    has its float32 Parameter back, and the output head is still tied to the embedding."""
    from selfdistill.models import attach_lora
    from selfdistill.rollout.weights import frozen_weights_in
    from tests.conftest import make_tiny_model

    base = make_tiny_model(seed=0)
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = attach_lora(base, rank=4, alpha=8)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B = 0 at init: make the adapter change the function
            p.data.normal_(0, 0.05, generator=torch.Generator().manual_seed(1))
    ids = torch.randint(3, model.config.vocab_size, (2, 9), generator=torch.Generator()
                        .manual_seed(2))
    params = {n: p for n, p in model.named_parameters()}
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.weight is embed.weight

    def loss_and_grads(dtype):
        model.train()
        model.zero_grad(set_to_none=True)
        with frozen_weights_in(model, dtype) as switched:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(input_ids=ids).logits.float()
            loss = torch.log_softmax(logits, -1)[..., 5].mean()
            loss.backward()
        return switched, loss.detach(), {n: p.grad.clone() for n, p in params.items()
                                         if p.grad is not None}

    n0, loss0, grads0 = loss_and_grads(None)
    n1, loss1, grads1 = loss_and_grads(torch.bfloat16)
    frozen = [m for m in model.modules() if type(m) is torch.nn.Linear
              and not m.weight.requires_grad]
    assert n0 == 0 and n1 == len(frozen) > 0
    assert torch.equal(loss0, loss1)
    assert grads0.keys() == grads1.keys() and grads0
    assert all(torch.equal(grads0[n], grads1[n]) for n in grads0)
    assert all(p is params[n] and p.dtype == torch.float32
               for n, p in model.named_parameters())
    assert head.weight is embed.weight
