"""Scaled dot-product attention that picks float32 where CPU bf16 attention is slower.

Under bf16 autocast, SDPA runs on bf16 inputs. PyTorch's CPU kernel for them has a large fixed
cost per call; at the sequence lengths of short-answer tasks the float32 kernel on the same
inputs is faster. Measured (`torch.nn.functional.scaled_dot_product_attention`, 8 rows × 9
query / 3 key-value heads × 64 dims, causal mask, median ms; 2-core AMD EPYC with AVX512-BF16,
2026-11-25; a 2-core Xeon with AMX gave the same picture the day before):

    keys:                          64           101          160          256
    forward+backward, bf16 / f32:  4.9 / 2.6    11.2 / 6.3   19.5 / 14.7  27.4 / 25.7
    forward only,     bf16 / f32:  1.16 / 1.06  2.49 / 2.38  4.81 / 4.82  9.46 / 9.11
    decode step (1 query, 100 keys): 0.34 vs 0.04 ms

So `attend` computes in float32 (autocast off, output cast back to bf16 as autocast would give
it) when autocast is on for a CPU in bf16 and either one query attends (a decode step) or there
are at most `SHORT_KEYS` keys; otherwise it is plain SDPA. The choice depends on shapes only,
not on grad mode, so a forward without gradients (`traces replay`, evaluation) computes what
the training forward computed. float32 attention is the more exact of the two: the rotated
queries and keys are float32 (the residual stream's dtype) and bf16 SDPA would round them.

`ATTENTION` is the same choice as a transformers attention implementation: `load_model` sets
it on models whose implementation is "sdpa" (transformers' own function does the masks and
grouped-query heads; only the precision differs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

ATTENTION = "selfdistill_sdpa"
SHORT_KEYS = 192
"""Most keys at which attention runs in float32 (forward+backward crosses over at ~220)."""


def in_float32(queries: int, keys: int, device: torch.device) -> bool:
    """Whether attention of `queries` over `keys` positions on `device` runs in float32."""
    if device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return False
    if torch.get_autocast_dtype("cpu") != torch.bfloat16:
        return False
    return queries == 1 or keys <= SHORT_KEYS


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, **kwargs)` in the precision `in_float32` picks.
    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D)."""
    if not in_float32(q.shape[-2], k.shape[-2], q.device):
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kwargs)
    return out.to(torch.bfloat16)


def _hf_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[Any, Any]:
    """transformers' SDPA attention function with `attend`'s precision choice."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if not in_float32(query.shape[-2], key.shape[-2], query.device):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    with torch.autocast("cpu", enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                              attention_mask, **kwargs)
    return out.to(torch.bfloat16), weights


def use(model: Any) -> None:
    """Give `model` (a transformers model using "sdpa") the `ATTENTION` implementation."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return
    AttentionInterface.register(ATTENTION, _hf_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)
    model.set_attn_implementation(ATTENTION)
