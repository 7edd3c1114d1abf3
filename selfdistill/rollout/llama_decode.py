"""A decode loop for Llama-architecture models that runs the layers directly, not `generate`.

A CPU decode step of a small model is mostly per-call overhead: for 8 rows × 1 token, HF
`generate` spends about a fifth of the step outside the weight matmuls in its own machinery —
mask building over the whole static cache, the cache's `update` bookkeeping, attention over
every unwritten cache column, stopping criteria, output buffers (default model, 8 rows × 64
tokens, float32, 2-core AVX2 EPYC: 5.9–6.1 s per `generate` call against 4.7–5.2 s here). This
loop keeps the model's own modules (embedding, RMSNorms, rotary embedding, projections — packed
or folded by `rollout.weights` —, MLP, head) and does only the rest itself:

    x = embed(token);  per layer:  h = norm₁(x),  q, k, v = proj(h),  q, k = rope(q, k, pos),
    cache[:, :, c] = k, v,  x += o(SDPA(q, K[:, :, :c+1], V[:, :, :c+1], mask)),
    x += mlp(norm₂(x));  logits = head(norm(x))

with c the step's cache column and attention over the columns written so far (masked where a
row is left padding). Token choice is HF's greedy decoding: argmax of the processed scores (a
`GumbelSampler` turns it into seeded sampling), a finished row gets the pad token, the loop
stops when every row has produced a stop token or at `max_new_tokens`. The prompt (after the
shared prefix already in the cache) is prefilled by the same layer loop, all its positions at
once under a causal mask. With `fused` projections (`rollout.weights.decode_weights(fuse=)`),
q/k/v and gate/up are one matmul each; attention runs in the precision `selfdistill.attention`
picks (float32 for a decode step under CPU bf16 autocast). Same function as `generate` up to
float rounding (attention over fewer masked columns sums in another order).

Used when `supports(model)`: a Llama-architecture model (`model_type` "llama" or "qwen2" —
the same layer structure; Qwen2's q/k/v biases live in its linear layers) with SDPA attention,
no sliding-window layer, and a generation config that adds no logits processor of its own
(repetition penalty, forced tokens, ...). Everything else goes through `generate`.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers import GenerationConfig

from selfdistill import attention

# generation-config fields that make HF `generate` add a logits processor or a stopping rule
# of its own; with any of them set away from its default the loop would not be `generate`
_GENERATE_EXTRAS = ("repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size",
                    "encoder_no_repeat_ngram_size", "bad_words_ids", "min_length",
                    "min_new_tokens", "suppress_tokens", "begin_suppress_tokens",
                    "forced_bos_token_id", "forced_eos_token_id", "sequence_bias",
                    "exponential_decay_length_penalty", "renormalize_logits", "max_time",
                    "stop_strings", "watermarking_config")


ARCHITECTURES = ("llama", "qwen2")
"""`model_type`s whose decoder layers the loop runs (tested against `generate` on each)."""


def _causal_lm(model: Any) -> Any:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def supports(model: Any) -> bool:
    """Whether `decode` computes what `generate` would for `model` (module docstring)."""
    lm = _causal_lm(model)
    cfg = getattr(lm, "config", None)
    if (getattr(cfg, "model_type", None) not in ARCHITECTURES
            or cfg._attn_implementation not in ("sdpa", attention.ATTENTION)):
        return False
    if any(getattr(layer.self_attn, "sliding_window", None) is not None
           for layer in lm.model.layers):
        return False
    gen, default = getattr(lm, "generation_config", None), GenerationConfig()
    return gen is None or all(getattr(gen, f, None) == getattr(default, f, None)
                              for f in _GENERATE_EXTRAS)


def _linear(module: Any) -> Any:
    """The callable a projection runs as: a LoRA layer whose adapter is off (folded into the
    packed weights by `rollout.weights`, or disabled) is its base layer, without PEFT's
    per-call dispatch."""
    if getattr(module, "disable_adapters", False) or getattr(module, "merged", False):
        return module.get_base_layer()
    return module


def fusable(model: Any) -> list[tuple[Any, ...]]:
    """Each decoder layer's sibling projections, for `decode_weights(fuse=)`: (q, k, v) and
    (gate, up) read the same input."""
    return [group for layer in _causal_lm(model).model.layers
            for group in ((layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
                          (layer.mlp.gate_proj, layer.mlp.up_proj))]


def _projections(group: tuple[Any, ...], fused: dict[tuple[int, ...], Any]) -> Any:
    """x ↦ the group's outputs: one fused call split, or each member called."""
    call = fused.get(tuple(id(m) for m in group))
    if call is None:
        members = [_linear(m) for m in group]
        return lambda x: [m(x) for m in members]
    sizes = [m.out_features for m in group]
    return lambda x: call(x).split(sizes, dim=-1)


@torch.no_grad()
def decode(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: Any, *, shared: int,
           max_new_tokens: int, stop_ids: list[int], pad_id: int,
           processor: Any = None, fused: dict[tuple[int, ...], Any] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode up to `max_new_tokens` tokens after left-padded prompts `ids` / `mask` (rows, W).

    `cache`: a static HF cache with room for W + max_new_tokens columns whose first `shared`
    columns are already filled (`rollout.hf.decode_cache`). `processor(seq, scores)`: an HF
    logits processor applied before the argmax (None = greedy). `fused`: `DecodeWeights.fused`
    of `decode_weights(fuse=fusable(model))`. Returns the new tokens (rows, steps) — pad after
    a row's stop token — and each token's log-prob under the raw (unprocessed, temperature 1)
    distribution, (rows, steps) float32, in nats.
    """
    lm = _causal_lm(model)
    body = lm.model
    # the architecture's own rotary application (the same formula in each module)
    rope = sys.modules[type(body.layers[0].self_attn).__module__].apply_rotary_pos_emb
    rows, width = ids.shape
    # positions as `generate` numbers them: real tokens from 0; padding gets 1 (never attended)
    pos = (mask.long().cumsum(-1) - 1).masked_fill_(mask == 0, 1)
    groups, fused = fusable(model), fused or {}  # groups: (q, k, v), (gate, up) per layer
    layers = [(layer.input_layernorm, _projections(attn_group, fused), _linear(
        layer.self_attn.o_proj), layer.post_attention_layernorm,
        _projections(mlp_group, fused), _linear(layer.mlp.down_proj), layer.mlp.act_fn,
        layer.self_attn.head_dim, layer.self_attn.scaling, cache_layer)
        for layer, attn_group, mlp_group, cache_layer in zip(
            body.layers, groups[0::2], groups[1::2], cache.layers, strict=True)]
    attend = torch.zeros(rows, cache.layers[0].max_cache_len, dtype=torch.bool, device=ids.device)
    attend[:, :width] = mask.bool()

    def forward(tokens: torch.Tensor, start: int) -> torch.Tensor:
        """Run `tokens` (rows, L) at cache columns start..start+L-1; the last position's logits.
        Query i sees the visible columns up to its own (a padding query sees itself: its output
        is never read, and an all-masked row would be NaN)."""
        n = tokens.shape[1]
        stop = start + n
        x = body.embed_tokens(tokens)  # (rows, L, H)
        cos, sin = body.rotary_emb(x, pos[:, start:stop] if n > 1 else pos[:, -1:] + stop - width)
        visible = attend[:, None, None, :stop].expand(rows, 1, n, stop)
        if n > 1:
            cols = torch.arange(stop, device=ids.device)
            causal = cols[None, :] <= cols[start:, None]  # (L, stop)
            visible = (visible & causal) | (cols[None, :] == cols[start:, None])
        for norm1, qkv, o_proj, norm2, gate_up, down, act, dim, scale, kv in layers:
            q, k, v = (t.view(rows, n, -1, dim).transpose(1, 2) for t in qkv(norm1(x)))
            q, k = rope(q, k, cos, sin)
            if not kv.is_initialized:  # HF's lazy allocation, on the first write
                kv.lazy_initialization(k, v)
            kv.keys[:, :, start:stop] = k
            kv.values[:, :, start:stop] = v
            a = attention.attend(q, kv.keys[:, :, :stop], kv.values[:, :, :stop],
                                 attn_mask=visible, scale=scale, enable_gqa=True)
            x = x + o_proj(a.transpose(1, 2).reshape(rows, n, -1))
            g, u = gate_up(norm2(x))
            x = x + down(act(g) * u)
        return lm.lm_head(body.norm(x[:, -1:]))[:, -1].float()

    logits = forward(ids[:, shared:], shared)
    stop = torch.tensor(stop_ids, device=ids.device)
    done = torch.zeros(rows, dtype=torch.bool, device=ids.device)
    seq, toks, lps = ids, [], []
    for t in range(max_new_tokens):
        scores = logits if processor is None else processor(seq, logits)
        tok = scores.argmax(-1).masked_fill_(done, pad_id)
        toks.append(tok)
        lps.append(torch.log_softmax(logits, dim=-1).gather(-1, tok[:, None])[:, 0])
        done |= torch.isin(tok, stop)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        if processor is not None:  # it reads the tokens so far (the seeded sampler: the last)
            seq = torch.cat([seq, tok[:, None]], dim=1)
        attend[:, width + t] = True
        logits = forward(tok[:, None], width + t)
    return torch.stack(toks, dim=1), torch.stack(lps, dim=1)
