"""`selfdistill.attention`: SDPA in float32 where CPU bf16 attention is slower — the same
function up to bf16 rounding of the inputs, which the float32 path skips."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from selfdistill import attention


def _qkv(tq: int, tk: int, *, grad: bool = False, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(2, 4, tq, 16), (2, 2, tk, 16), (2, 2, tk, 16)]  # grouped-query heads
    return [torch.randn(s, generator=g).requires_grad_(grad) for s in shapes]


@pytest.mark.parametrize("autocast, queries, keys, grad, want", [
    (None, 1, 50, False, False),                       # no autocast: plain SDPA
    (torch.float16, 1, 50, False, False),              # another autocast dtype
    (torch.bfloat16, 1, 500, False, True),             # a decode step, any length
    (torch.bfloat16, 50, 50, True, True),              # short training forward
    (torch.bfloat16, 50, attention.SHORT_KEYS, True, True),
    (torch.bfloat16, 50, attention.SHORT_KEYS + 1, True, False),  # long: bf16 is faster
    (torch.bfloat16, 50, 50, False, True),             # the same without gradients (replay)
    (torch.bfloat16, 50, 500, False, False),
])
def test_which_attention_runs_in_float32(autocast, queries, keys, grad, want):
    with (torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None),
          torch.set_grad_enabled(grad)):
        assert attention.in_float32(queries, keys, torch.device("cpu")) is want
    assert attention.in_float32(queries, keys, torch.device("meta")) is False


def test_attend_in_float32_is_sdpa_on_the_unrounded_inputs():
    """Under bf16 autocast, `attend` gives float32 SDPA's output rounded once to bf16 (the dtype
    autocast would give), is closer to it than bf16 SDPA, and its gradients reach the float32
    inputs as float32 SDPA's do (up to that final rounding)."""
    q, k, v = _qkv(12, 12, grad=True)
    mask = torch.ones(12, 12, dtype=torch.bool).tril()
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    ref_grads = torch.autograd.grad(ref.square().sum(), [q, k, v])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = attention.attend(q, k, v, attn_mask=mask, enable_gqa=True)
        rounded = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert ours.dtype == rounded.dtype == torch.bfloat16
    assert torch.equal(ours, ref.detach().to(torch.bfloat16))
    assert (ours.float() - ref).abs().max() < (rounded.float() - ref).abs().max()
    grads = torch.autograd.grad(ours.float().square().sum(), [q, k, v])
    for g, r in zip(grads, ref_grads, strict=True):
        assert g.dtype == torch.float32
        assert torch.allclose(g, r, rtol=2e-2, atol=2e-2)


def test_attend_is_plain_sdpa_when_float32_is_not_chosen():
    q, k, v = _qkv(3, attention.SHORT_KEYS + 1)  # several queries over many keys
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(attention.attend(q, k, v, enable_gqa=True),
                           F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
    assert torch.equal(attention.attend(q, k, v, enable_gqa=True),
                       F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def test_load_model_gives_the_model_the_attention(tmp_path, tokenizer):
    """`load_model` switches an SDPA model to `ATTENTION`: without autocast its logits are
    bit-identical to SDPA's; under bf16 autocast with gradients (a short training forward) they
    are closer to the float32 model's than SDPA's, and the backward runs. A model on another
    attention implementation is left as it is."""
    from selfdistill.models import load_model
    from tests.conftest import make_tiny_model

    make_tiny_model(seed=3).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    ours = load_model(str(tmp_path), progress=False).model
    assert ours.config._attn_implementation == attention.ATTENTION
    sdpa = make_tiny_model(seed=3)
    assert sdpa.config._attn_implementation == "sdpa"
    ids = torch.randint(3, 1000, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = sdpa(input_ids=ids).logits
        assert torch.equal(ours(input_ids=ids).logits, exact)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mine = ours(input_ids=ids).logits.float()
        theirs = sdpa(input_ids=ids).logits.float()
    mine.sum().backward()
    assert all(p.grad is not None for p in ours.parameters() if p.requires_grad)
    assert (mine - exact).abs().mean() < (theirs.detach() - exact).abs().mean()

    eager = make_tiny_model(seed=3)
    eager.set_attn_implementation("eager")
    attention.use(eager)
    assert eager.config._attn_implementation == "eager"
