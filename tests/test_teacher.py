"""selfdistill.teacher: contexts (templates), regimes (teacher weights), scoring (alignment)."""

from __future__ import annotations

import copy

import pytest
import torch

from selfdistill.chat import prompt_ids
from selfdistill.models import attach_lora
from selfdistill.teacher import (
    ContextTemplates,
    PrivilegedContext,
    build_batch,
    build_teacher_messages,
    completion_logits,
    length_groups,
    make_regime,
    model_logits,
    score_completions,
)

ATOL = 1e-5


def _lora(model, dropout: float = 0.0):
    """LoRA-wrapped tiny model whose adapter is not a no-op (PEFT initialises B to zero)."""
    peft_model = attach_lora(model, rank=4, alpha=8, dropout=dropout)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    return peft_model


def _inputs(prompt: list[int], completion: list[int]):
    batch = build_batch([prompt], [completion], pad_id=0)
    return batch.input_ids, batch.attention_mask, batch.position_ids, len(completion)


def _unpadded(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Reference: plain forward on prompt+completion, positions predicting the completion."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(completion)]


def _trainable(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


# --- scoring: alignment ---------------------------------------------------------------------


def test_completion_logits_align_with_unpadded_forward(tokenizer, tiny_model):
    prompts = [
        prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}]),
        prompt_ids(
            tokenizer,
            [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a prime number larger than ten, please."},
            ],
        ),
    ]
    completions = [
        tokenizer("Paris.", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id],
        tokenizer("Eleven is prime, and so is 13.", add_special_tokens=False)["input_ids"],
    ]
    assert len(prompts[0]) != len(prompts[1]) and len(completions[0]) != len(completions[1])
    batch = build_batch(prompts, completions, tokenizer.pad_token_id)
    logits = completion_logits(tiny_model, batch)
    width_t = max(map(len, completions))
    assert logits.shape == (2, width_t, tiny_model.config.vocab_size)
    assert batch.prompt_width == max(map(len, prompts))
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        n = len(completion)
        torch.testing.assert_close(
            logits[i, :n], _unpadded(tiny_model, prompt, completion), atol=ATOL, rtol=0
        )
        assert batch.completion_ids[i, :n].tolist() == completion
        # Positions count from each row's first real token (rotary models would hide an offset).
        start = batch.prompt_width - len(prompt)
        assert batch.position_ids[i, start : start + len(prompt) + n].tolist() == list(
            range(len(prompt) + n)
        )
        assert batch.completion_mask[i].tolist() == [True] * n + [False] * (width_t - n)
    # Left padding on the shorter prompt, right padding on the shorter completion.
    short_prompt = min(range(2), key=lambda i: len(prompts[i]))
    short_completion = min(range(2), key=lambda i: len(completions[i]))
    assert batch.attention_mask[short_prompt, 0] == 0
    assert batch.attention_mask[short_completion, -1] == 0
    assert batch.attention_mask.sum().item() == sum(map(len, prompts + completions))


def test_model_logits_keep_exactly_the_completion_positions(tiny_model):
    """The head runs at the T predicting positions only (a contiguous (B, T, V) block, no slice
    whose backward would zero-fill (B, T+1, V)); a model that ignores `logits_to_keep` and returns
    every position gives the same logits; a completion that leaves no prompt column is refused."""
    batch = build_batch([[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]], pad_id=0)
    inputs = (batch.input_ids, batch.attention_mask, batch.position_ids, 3)
    kept = model_logits(tiny_model, *inputs)
    assert kept.shape == (2, 3, tiny_model.config.vocab_size) and kept.is_contiguous()

    def every_position(**kwargs):
        kwargs.pop("logits_to_keep")
        return tiny_model(**kwargs)

    torch.testing.assert_close(model_logits(every_position, *inputs), kept, atol=ATOL, rtol=0)
    with pytest.raises(ValueError, match="completion_width=6 needs 7 columns"):
        model_logits(tiny_model, *inputs[:3], 6)


def test_alignment_holds_for_absolute_position_embeddings():
    """GPT-2 adds learned position embeddings: wrong positions under left padding would show."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=64,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(cfg).eval()
    prompts, completions = [[1, 2, 3], [4, 5, 6, 7, 8, 9]], [[10, 11, 12], [13]]
    logits = completion_logits(model, build_batch(prompts, completions, pad_id=0))
    for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
        torch.testing.assert_close(
            logits[i, : len(completion)], _unpadded(model, prompt, completion), atol=ATOL, rtol=0
        )


# --- scoring: a shared prefix ---------------------------------------------------------------

# Prompts opening with the same 4 tokens (a system prompt's role), of different lengths.
SHARED_PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 5, 6, 7, 10], [1, 5, 6, 7, 8, 11, 12, 13]]
SHARED_COMPLETIONS = [[20, 21], [22, 23, 24, 25], [26]]


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)).eval()


def test_shared_prefix_layout_keeps_every_row_its_own_tokens_and_positions():
    b = build_batch(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0, share_prefix=True)
    plain = build_batch(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0)
    assert b.prefix_width == 4 and plain.prefix_width == 0
    assert b.prompt_width == plain.prompt_width == 8
    assert torch.equal(b.completion_ids, plain.completion_ids)
    assert torch.equal(b.completion_mask, plain.completion_mask)
    for i, prompt in enumerate(SHARED_PROMPTS):
        real = b.attention_mask[i].bool()
        row = SHARED_PROMPTS[i] + SHARED_COMPLETIONS[i]
        assert b.input_ids[i][real].tolist() == row  # [prefix | pad … rest | completion …]
        assert b.position_ids[i][real].tolist() == list(range(len(row)))
        assert b.input_ids[i, :4].tolist() == prompt[:4] and real[:4].all()
    # Every prompt keeps at least one token of its own, even when all prompts are the same.
    same = build_batch([[3, 4, 5]] * 2, [[6], [7]], pad_id=0, share_prefix=True)
    assert same.prefix_width == 2
    assert build_batch([[3, 4], [9, 4]], [[6], [7]], pad_id=0, share_prefix=True).prefix_width == 0


@pytest.mark.parametrize("arch", ["llama-lora", "gpt2"])
def test_shared_prefix_gives_the_plain_forwards_logits_and_gradients(arch, tiny_model):
    """The prefix runs once and its keys/values are repeated to every row: the student's
    logits and their gradient, and every regime's teacher logits, equal the plain layout's
    (GPT-2: absolute position embeddings would expose a wrong position)."""
    model = _lora(tiny_model) if arch == "llama-lora" else _gpt2()
    params = _trainable(model)
    shared = build_batch(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0, share_prefix=True)
    plain = build_batch(SHARED_PROMPTS, SHARED_COMPLETIONS, pad_id=0)
    w = torch.randn(3, 4, generator=torch.Generator().manual_seed(5))
    out = {}
    for name, batch in (("shared", shared), ("plain", plain)):
        logits = completion_logits(model, batch)
        loss = (logits.log_softmax(-1)[..., 7] * w * batch.completion_mask).sum()
        out[name] = (logits.detach(), torch.autograd.grad(loss, list(params.values())))
    mask = plain.completion_mask
    torch.testing.assert_close(out["shared"][0][mask], out["plain"][0][mask], atol=ATOL, rtol=0)
    for g_shared, g_plain in zip(out["shared"][1], out["plain"][1], strict=True):
        torch.testing.assert_close(g_shared, g_plain, atol=1e-6, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in out["plain"][1])
    regimes = ["base", "live", "ema"] if arch == "llama-lora" else ["live"]
    for name in regimes:
        regime = make_regime(name)
        a = regime.teacher_logits(model, *_batch_inputs(shared))
        b = regime.teacher_logits(model, *_batch_inputs(plain))
        torch.testing.assert_close(a[mask], b[mask], atol=ATOL, rtol=0)


def _batch_inputs(batch):
    return (batch.input_ids, batch.attention_mask, batch.position_ids,
            batch.completion_ids.shape[1], batch.prefix_width)


def test_length_groups_split_two_length_clusters_and_cover_every_row_once():
    lengths = [70, 38, 72, 36, 68, 40, 37, 75]
    groups = length_groups(lengths, overhead=64)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert [sorted(lengths[i] for i in g) for g in groups] == [[36, 37, 38, 40],
                                                               [68, 70, 72, 75]]
    assert length_groups(lengths, overhead=10_000) == [sorted(range(8), key=lambda i: lengths[i])]
    assert length_groups([]) == []


def test_build_batch_rejects_unscorable_input():
    with pytest.raises(ValueError, match="at least one token"):
        build_batch([[]], [[1]], pad_id=0)
    with pytest.raises(ValueError, match="nothing to score"):
        build_batch([[1], [2]], [[], []], pad_id=0)


def test_score_completions_lines_up_teacher_and_student(tiny_model):
    model = _lora(tiny_model)
    student = [[5, 6, 7], [8, 9]]
    teacher = [[11, 12, 13, 5, 6, 7], [14, 8, 9]]
    completions = [[20, 21], [22, 23, 24]]
    scored = score_completions(model, make_regime("base"), student, teacher, completions, 0)
    assert scored.student_logits.shape == scored.teacher_logits.shape == (2, 3, 49152)
    assert scored.student_logits.requires_grad and not scored.teacher_logits.requires_grad
    assert scored.mask.tolist() == [[True, True, False], [True, True, True]]
    assert scored.completion_ids[1].tolist() == [22, 23, 24]
    with model.disable_adapter():
        torch.testing.assert_close(
            scored.teacher_logits[0, :2],
            _unpadded(model, teacher[0], completions[0]),
            atol=ATOL,
            rtol=0,
        )
    torch.testing.assert_close(
        scored.student_logits[1].detach(),
        _unpadded(model, student[1], completions[1]),
        atol=ATOL,
        rtol=0,
    )
    # Gradients reach the adapter through the padded positions without NaNs.
    (scored.student_logits[scored.mask].logsumexp(-1).sum()).backward()
    grads = [p.grad for p in _trainable(model).values()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


# --- regimes --------------------------------------------------------------------------------


def test_base_is_adapter_disabled_and_live_is_current_student(tiny_model):
    model = _lora(tiny_model)
    prompt, completion = [3, 4, 5], [6, 7]
    base = make_regime("base").teacher_logits(model, *_inputs(prompt, completion))[0]
    live = make_regime("live").teacher_logits(model, *_inputs(prompt, completion))[0]
    with model.disable_adapter():
        torch.testing.assert_close(base, _unpadded(model, prompt, completion), atol=ATOL, rtol=0)
    torch.testing.assert_close(live, _unpadded(model, prompt, completion), atol=ATOL, rtol=0)
    assert (base - live).abs().max() > 1e-3  # the perturbed adapter really changes the logits


def test_teacher_forward_restores_mode_flags_and_adapter(tiny_model):
    model = _lora(tiny_model, dropout=0.5)
    model.train()
    before = {n: p.requires_grad for n, p in model.named_parameters()}
    inputs = _inputs([3, 4, 5], [6, 7])
    # A student graph built BEFORE the teacher forwards must still backpropagate afterwards.
    student_loss = model(torch.tensor([[3, 4, 5]])).logits.sum()
    for name in ("base", "live", "ema", "trust_region"):
        a = make_regime(name).teacher_logits(model, *inputs)
        b = make_regime(name).teacher_logits(model, *inputs)
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # eval mode: dropout is off
        assert all(m.training for m in model.modules()), name
        assert model.active_adapter == "default"
        assert {n: p.requires_grad for n, p in model.named_parameters()} == before, name
    student_loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in _trainable(model).values())


def test_trust_region_is_lerp_of_base_and_live(tiny_model):
    model = _lora(tiny_model)
    inputs = _inputs([3, 4, 5], [6, 7])
    base = make_regime("base").teacher_logits(model, *inputs)
    live = make_regime("live").teacher_logits(model, *inputs)
    mixed = make_regime("trust_region", rate=0.3).teacher_logits(model, *inputs)
    torch.testing.assert_close(mixed, 0.7 * base + 0.3 * live, atol=ATOL, rtol=0)


def test_ema_follows_the_recursion_and_stays_out_of_the_optimizer(tiny_model):
    model = _lora(tiny_model)
    rate, inputs = 0.25, _inputs([3, 4, 5], [6, 7])
    regime = make_regime("ema", rate=rate)
    trainable_before = set(_trainable(model))
    regime.setup(model)
    expected = {n: p.detach().clone() for n, p in _trainable(model).items()}
    torch.manual_seed(2)
    for _ in range(3):  # fake optimizer steps: student weights set to known values
        with torch.no_grad():
            for n, p in _trainable(model).items():
                p.copy_(torch.randn_like(p))
                expected[n] = (1 - rate) * expected[n] + rate * p
        regime.after_step(model)
    ema = regime.state_dict()["ema"]
    assert set(ema) == trainable_before and regime.state_dict()["steps"] == 3
    for n, value in expected.items():
        torch.testing.assert_close(ema[n], value, atol=1e-6, rtol=0)
        assert not ema[n].requires_grad
    assert set(_trainable(model)) == trainable_before
    ids = {id(p) for p in model.parameters()}
    assert not any(id(t) in ids for t in ema.values())

    # The teacher forward runs with the EMA weights: compare with a copy holding them.
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in reference.named_parameters():
            if n in expected:
                p.copy_(expected[n])
    teacher = regime.teacher_logits(model, *inputs)[0]
    torch.testing.assert_close(teacher, _unpadded(reference, [3, 4, 5], [6, 7]), atol=ATOL, rtol=0)
    assert (teacher - _unpadded(model, [3, 4, 5], [6, 7])).abs().max() > 1e-4


def test_ema_requires_setup_before_first_step(tiny_model):
    with pytest.raises(RuntimeError, match="before the first optimizer step"):
        make_regime("ema").after_step(_lora(tiny_model))


def test_regime_state_round_trip(tiny_model):
    model = _lora(tiny_model)
    inputs = _inputs([3, 4, 5], [6, 7])
    regime = make_regime("ema", rate=0.5)
    regime.setup(model)
    with torch.no_grad():
        for p in _trainable(model).values():
            p.add_(1.0)
    regime.after_step(model)
    restored = make_regime("ema", rate=0.5)
    restored.load_state_dict(regime.state_dict())
    torch.testing.assert_close(
        restored.teacher_logits(model, *inputs),
        regime.teacher_logits(model, *inputs),
        atol=0,
        rtol=0,
    )
    restored.after_step(model)  # the restored copy is independent of the original's tensors
    assert restored.state_dict()["steps"] == 2 and regime.state_dict()["steps"] == 1
    with pytest.raises(ValueError, match="regime 'ema', not 'base'"):
        make_regime("base").load_state_dict(regime.state_dict())


def test_full_finetuning_base_and_ema_use_parameter_copies(tiny_model):
    model = tiny_model  # no adapter: every parameter trainable
    prompt, completion = [3, 4, 5], [6, 7]
    inputs = _inputs(prompt, completion)
    initial = _unpadded(model, prompt, completion)
    base, ema = make_regime("base"), make_regime("ema", rate=1.0)
    base.setup(model)
    ema.setup(model)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(3.0)
    ema.after_step(model)  # rate 1: the EMA is the current weights
    now = _unpadded(model, prompt, completion)
    assert (now - initial).abs().max() > 1e-3
    torch.testing.assert_close(
        base.teacher_logits(model, *inputs)[0], initial, atol=ATOL, rtol=0
    )
    torch.testing.assert_close(ema.teacher_logits(model, *inputs)[0], now, atol=ATOL, rtol=0)


def test_make_regime_rejects_unknown_names_and_rates():
    with pytest.raises(ValueError, match="base, live, ema, trust_region"):
        make_regime("frozen")
    with pytest.raises(ValueError, match="rate"):
        make_regime("ema", rate=0.0)


# --- contexts -------------------------------------------------------------------------------

CHAT = [
    {"role": "system", "content": "You are helpful."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Add 2 and 3."},
]


@pytest.mark.parametrize(
    "kind", ["demonstration", "fact", "solution", "feedback", "ground_truth", "user_followup"]
)
def test_each_kind_renders_into_last_user_turn(kind):
    templates = ContextTemplates()
    out = build_teacher_messages(CHAT, [PrivilegedContext(kind, "SECRET-TEXT")])
    assert out.messages[:3] == CHAT[:3]  # system and earlier turns untouched
    expected_block = getattr(templates, kind).format(text="SECRET-TEXT")
    assert out.messages[3] == {
        "role": "user",
        "content": templates.wrapper.format(prompt="Add 2 and 3.", context=expected_block),
    }
    assert out.truncated_tokens == 0
    assert CHAT[3]["content"] == "Add 2 and 3."  # the student's messages are not mutated


def test_contexts_combine_in_order_and_templates_are_overridable():
    templates = ContextTemplates(
        solution="[S:{text}]", feedback="[F:{text}]", wrapper="{prompt}|{context}"
    )
    out = build_teacher_messages(
        "Fix the bug.",
        [PrivilegedContext("solution", "x"), PrivilegedContext("test_failure", "y")],
        templates=templates,
    )
    assert out.messages == [{"role": "user", "content": "Fix the bug.|[S:x][F:y]"}]
    assert build_teacher_messages(CHAT, []).messages == CHAT
    with pytest.raises(ValueError, match="placeholders"):
        ContextTemplates(feedback="no placeholder")


def test_truncation_cuts_the_requested_side_and_reports_it(tokenizer):
    text = "alpha beta gamma delta epsilon zeta eta theta iota kappa"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    templates = ContextTemplates(feedback="{text}", wrapper="{context}{prompt}")
    for side, kept in (("left", ids[-4:]), ("right", ids[:4])):
        out = build_teacher_messages(
            "Q",
            [PrivilegedContext("feedback", text)],
            templates=templates,
            tokenizer=tokenizer,
            max_context_tokens=4,
            truncate=side,
        )
        assert out.messages[0]["content"] == tokenizer.decode(kept) + "Q"
        assert out.truncated_tokens == len(ids) - 4
    short = build_teacher_messages(
        "Q",
        [PrivilegedContext("feedback", "ok")],
        templates=templates,
        tokenizer=tokenizer,
        max_context_tokens=4,
    )
    assert short.truncated_tokens == 0 and short.messages[0]["content"] == "okQ"
    with pytest.raises(ValueError, match="tokenizer"):
        build_teacher_messages("Q", [], max_context_tokens=4)


def test_unknown_kind_and_missing_user_turn_raise():
    with pytest.raises(ValueError, match="demonstration, fact, solution, feedback"):
        PrivilegedContext("hint", "x")
    with pytest.raises(ValueError, match="no user turn"):
        build_teacher_messages(
            [{"role": "system", "content": "s"}], [PrivilegedContext("feedback", "x")]
        )
