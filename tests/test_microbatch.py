"""Micro-batched student forward+backward gives the full batch's loss and gradient."""

from __future__ import annotations

import copy
from contextlib import nullcontext

import pytest
import torch

from selfdistill.data import Row
from selfdistill.errors import ConfigError
from selfdistill.models import attach_lora
from selfdistill.teacher import make_regime
from selfdistill.train.config import load_config
from selfdistill.train.loop import PhaseTimer, score_batch
from selfdistill.train.methods import Sample
from selfdistill.train.microbatch import length_order, merge_metrics, student_backward

PAD = 2


def _samples(method: str) -> list[Sample]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, (p_len, c_len) in enumerate([(3, 5), (6, 2), (4, 7), (2, 1), (5, 4)]):
        prompt = torch.randint(3, 500, (p_len,), generator=gen).tolist()
        completion = torch.randint(3, 500, (c_len,), generator=gen).tolist()
        row = Row(messages=[{"role": "user", "content": "q"}], answers=["a"],
                  privileged_context="fact", source="t")
        s = Sample(i, row, i // 1, prompt, completion)
        if method == "sdft" and i != 3:  # one row without teacher context: no loss tokens
            s.teacher_prompt = torch.randint(3, 500, (p_len + 3,), generator=gen).tolist()
        out.append(s)
    return out


def _sharp_lora(tiny_model):
    """The tiny model with sharper distributions than the random init's near-uniform ones and a
    LoRA adapter whose B is nonzero, so student (adapter on) and teacher (off) differ."""
    with torch.no_grad():
        tiny_model.get_input_embeddings().weight.mul_(50.0)
    model = attach_lora(tiny_model, rank=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


def _grads(cfg, model, samples, update=0):
    ctx_rows, t_logits, sb = score_batch(make_regime("base"), model, samples, PAD, PhaseTimer())
    model.zero_grad(set_to_none=True)
    loss, metrics = student_backward(cfg, model, samples, sb, t_logits, ctx_rows, update, PAD,
                                     nullcontext)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return float(loss), metrics, grads


@pytest.mark.parametrize("method,estimator", [("sdft", "topk"), ("sdft", "full"), ("sft", "full")])
def test_micro_batches_give_the_full_batch_gradient(tiny_model, method, estimator):
    model = _sharp_lora(tiny_model)
    base = [f"method={method}", "train_data=x.jsonl", f"loss.estimator={estimator}",
            "loss.topk=20", "probe_data=null"]
    full_cfg = load_config(None, base)
    micro_cfg = load_config(None, [*base, "micro_batch_size=2"])
    samples = _samples(method)
    loss_f, m_f, g_f = _grads(full_cfg, model, copy.deepcopy(samples))
    loss_m, m_m, g_m = _grads(micro_cfg, model, copy.deepcopy(samples))
    assert loss_f > 1e-2  # a real signal, not two zeros
    assert loss_m == pytest.approx(loss_f, rel=1e-5)
    assert g_f.keys() == g_m.keys() and g_f
    for name, g in g_f.items():
        # float32 summation order differs (padding widths, accumulation): tolerance relative
        # to the tensor's largest entry
        torch.testing.assert_close(g_m[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()))
    key = "distill_loss" if method == "sdft" else "nll"
    assert m_m[key] == pytest.approx(m_f[key], rel=1e-5)


@pytest.mark.parametrize("estimator", ["topk", "full"])
def test_chunked_loss_in_the_trainer_gives_the_plain_gradient(tiny_model, estimator):
    """`loss.chunk_size` (whose backward writes the gradient over the trainer's row copy of the
    student logits) gives the plain path's loss and gradient, at the first update and at an
    importance-corrected second one, with micro-batches too."""
    model = _sharp_lora(tiny_model)
    base = ["train_data=x.jsonl", f"loss.estimator={estimator}", "loss.topk=20",
            "probe_data=null"]
    samples = _samples("sdft")
    _grads(load_config(None, base), model, samples)  # update 0: records the old log-probs
    for update in (0, 1):
        loss_p, _, g_p = _grads(load_config(None, base), model, copy.deepcopy(samples), update)
        for extra in (["loss.chunk_size=3"], ["loss.chunk_size=3", "micro_batch_size=2"]):
            cfg = load_config(None, [*base, *extra])
            loss_c, _, g_c = _grads(cfg, model, copy.deepcopy(samples), update)
            assert loss_c == pytest.approx(loss_p, rel=1e-5) and loss_p > 1e-2
            assert g_c.keys() == g_p.keys() and g_p
            for name, g in g_p.items():
                # two formulas for the same gradient (closed form vs autograd): float32
                # rounding relative to the tensor's largest entry
                torch.testing.assert_close(g_c[name], g, rtol=1e-4,
                                           atol=5e-5 * float(g.abs().max()))


def test_micro_batches_with_anchors_give_the_full_batch_gradient(tiny_model):
    """Task rows and anchor rows are two token means with their own weight: each micro-batch
    uses the whole batch's denominators, so the micro-batch losses still sum to the loss."""
    model = _sharp_lora(tiny_model)
    samples = _samples("sdft")
    for s in samples[3:]:  # rows 3 and 4: anchors, the teacher reads the student's prompt
        s.anchor, s.teacher_prompt = True, s.prompt
    base = ["train_data=x.jsonl", "probe_data=null", "anchor_data=builtin",
            "anchor_batch_size=2", "loss.anchor_weight=3", "loss.estimator=full"]
    loss_f, m_f, g_f = _grads(load_config(None, base), model, copy.deepcopy(samples))
    for size in (1, 2, 3):
        cfg = load_config(None, [*base, f"micro_batch_size={size}"])
        loss_m, _, g_m = _grads(cfg, model, copy.deepcopy(samples))
        assert loss_m == pytest.approx(loss_f, rel=1e-5) and loss_f > 1e-2
        for name, g in g_f.items():
            torch.testing.assert_close(g_m[name], g, rtol=1e-4, atol=1e-5 * float(g.abs().max()))
    assert m_f["anchor_distill_loss"] > 0


def test_micro_batching_is_rejected_where_it_would_not_be_exact():
    with pytest.raises(ConfigError, match="distillation_weight"):
        load_config(None, ["train_data=x", "method=sdpo", "num_generations=2",
                           "micro_batch_size=2", "loss.distillation_weight=0.5"])
    with pytest.raises(ConfigError, match="multiple of num_generations"):
        load_config(None, ["train_data=x", "method=grpo", "num_generations=4",
                           "micro_batch_size=2"])
    assert load_config(None, ["train_data=x", "method=grpo", "num_generations=2",
                              "micro_batch_size=4"]).micro_batch_size == 4


def test_merge_metrics_weights_means_and_keeps_extremes():
    parts = [(0.25, {"loss": 2.0, "adv_min": -1.0, "adv_max": 1.0}),
             (0.75, {"loss": 4.0, "adv_min": -3.0, "adv_max": 0.5}),
             (0.0, {"loss": 9.0, "adv_min": -9.0, "adv_max": 9.0})]  # no tokens: no say
    assert merge_metrics(parts) == {"loss": 3.5, "adv_min": -3.0, "adv_max": 1.0}


def test_length_order_groups_similar_lengths_but_keeps_grpo_groups():
    samples = _samples("sdft")
    order = length_order("sdft", samples)
    lengths = [len(samples[i].completion) for i in order]
    assert lengths == sorted(lengths) and sorted(order) == list(range(len(samples)))
    assert length_order("grpo", samples) == list(range(len(samples)))
