"""In-process generation with Hugging Face `generate` (KV cache, batched, left padding)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import LogitsProcessorList

from selfdistill.models import cache_arg
from selfdistill.rollout import llama_decode
from selfdistill.rollout.seeding import GumbelSampler
from selfdistill.rollout.weights import decode_weights
from selfdistill.teacher.regimes import prefill
from selfdistill.teacher.scoring import common_prefix, left_pad


@dataclass
class Completion:
    """One sampled completion of one prompt.

    `token_ids` are the generated tokens (no padding), ending with EOS when `finished`;
    `logprobs[i]` is log pi(token_ids[i] | prompt, token_ids[:i]) under the sampler's raw
    (temperature 1, unfiltered) distribution, in nats.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    text: str
    finished: bool
    meta: dict[str, Any] = field(default_factory=dict)


def decode_cache(model: Any, ids: torch.Tensor, shared: int, max_new_tokens: int) -> Any:
    """A static KV cache for one `generate` call: per layer, keys and values of shape
    (rows, kv heads, W + max_new_tokens, head dim) for prompts padded to width W, allocated once
    and written in place at each decode step (a DynamicCache concatenates every layer's keys
    and values onto a new tensor at every step: aten::cat was 20 % of a CPU decode step of the
    default model, 8 rows × 64 tokens). Unwritten columns are masked, so attention reads the
    same keys as before. When every row opens with the same `shared` tokens (a chat
    template's system prompt: 24 tokens of ~38), their keys and values are computed once
    (batch 1) and copied into every row; `generate` then prefills only the columns after them.
    Returns None (HF's default dynamic cache) for a model whose layers have no static kind."""
    from transformers import StaticCache

    try:
        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + max_new_tokens)
    except (KeyError, ValueError, NotImplementedError):
        return None
    if shared and ids.shape[0] > 1:
        prefix = ids[:1, :shared]
        filled = prefill(model, prefix, torch.ones_like(prefix),
                         torch.arange(shared, device=ids.device)[None])
        rows = ids.shape[0]
        for layer, part in zip(cache.layers, filled.layers, strict=True):
            layer.update(part.keys.expand(rows, -1, -1, -1), part.values.expand(rows, -1, -1, -1))
    return cache


@torch.no_grad()
def generate(
    model: Any,
    tokenizer: Any,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 64,
    n: int = 1,
    temperature: float = 1.0,
    top_p: float = 1.0,
    greedy: bool = False,
    batch_size: int = 16,
    on_batch: Callable[[int], None] | None = None,
    seeds: list[int] | None = None,
    fold_lora: bool = True,
    pack_weights: bool = True,
    decode_loop: bool = True,
) -> list[list[Completion]]:
    """Sample `n` completions for each prompt (token ids, already chat-templated).

    Returns a list with one entry per prompt, each a list of `n` completions. Generation stops
    per row at EOS (the row is then padded); `greedy=True` ignores temperature and top_p.
    Batches hold up to `batch_size` rows (prompt copies for n > 1 share a batch).
    `on_batch(rows_done)` is called after each batch, e.g. to advance a progress bar.
    `seeds` (one per completion, prompt-major: prompt i's j-th is `seeds[i * n + j]`) makes each
    completion a pure function of its seed, whatever the batching (`rollout.seeding`).
    `fold_lora` / `pack_weights` decode through LoRA-folded / oneDNN-packed copies of the frozen
    weights (`rollout.weights.decode_weights`): the same function, fewer and faster calls.
    `decode_loop`: greedy and seeded decoding of a Llama model run `rollout.llama_decode`'s loop
    instead of HF `generate` (the same function, less per-step overhead).
    """
    # the loop covers greedy and seeded decoding; HF's own sampler stays with `generate`
    loop = (decode_loop and max_new_tokens > 0 and (greedy or seeds is not None)
            and llama_decode.supports(model))
    fuse = llama_decode.fusable(model) if loop else ()
    with decode_weights(model, fold=fold_lora, pack=pack_weights, fuse=fuse) as prepared:
        return _generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, n=n,
                         temperature=temperature, top_p=top_p, greedy=greedy,
                         batch_size=batch_size, on_batch=on_batch, seeds=seeds,
                         loop=loop, fused=prepared.fused)


def _generate(model: Any, tokenizer: Any, prompts: list[list[int]], *, max_new_tokens: int,
              n: int, temperature: float, top_p: float, greedy: bool, batch_size: int,
              on_batch: Callable[[int], None] | None,
              seeds: list[int] | None, loop: bool,
              fused: dict[tuple[int, ...], Any]) -> list[list[Completion]]:
    was_training = model.training
    model.eval()
    stop_ids = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id
    flat = [p for p in prompts for _ in range(n)]
    if seeds is not None and len(seeds) != len(flat):
        raise ValueError(f"need one seed per completion ({len(flat)}), got {len(seeds)}")
    out: list[Completion] = []
    for start in range(0, len(flat), batch_size):
        chunk = flat[start:start + batch_size]
        shared = common_prefix(chunk) if len(chunk) > 1 else 0
        ids, mask = (t.to(model.device) for t in left_pad(chunk, pad_id, shared))
        kwargs: dict[str, Any] = {"do_sample": False} if greedy else {
            "do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
        sampler = None
        if seeds is not None and not greedy:  # seeded Gumbel-max on top of greedy decoding
            sampler = GumbelSampler(seeds[start:start + batch_size], temperature=temperature,
                                    top_p=top_p)
            kwargs = {"do_sample": False, "logits_processor": LogitsProcessorList([sampler])}
        cache = decode_cache(model, ids, shared, max_new_tokens)
        if loop and cache is not None:
            new, lp = llama_decode.decode(model, ids, mask, cache, shared=shared,
                                          max_new_tokens=max_new_tokens, stop_ids=stop_ids,
                                          pad_id=pad_id, processor=sampler, fused=fused)
        else:
            new, lp = _hf_generate(model, ids, mask, cache, max_new_tokens, pad_id, stop_ids,
                                   sampler, kwargs)
        for row, prompt in enumerate(chunk):
            toks, lps, finished = [], [], False
            for t in range(new.shape[1]):
                tok = int(new[row, t])
                toks.append(tok)
                lps.append(float(lp[row, t]))
                if tok in stop_ids:
                    finished = True
                    break
            text = tokenizer.decode(toks, skip_special_tokens=True)
            out.append(Completion(list(prompt), toks, lps, text, finished))
        if on_batch is not None:
            on_batch(len(chunk))
    model.train(was_training)
    return [out[i * n:(i + 1) * n] for i in range(len(prompts))]


def _hf_generate(model: Any, ids: torch.Tensor, mask: torch.Tensor, cache: Any,
                 max_new_tokens: int, pad_id: int, stop_ids: list[int], sampler: Any,
                 kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """HF `generate` for what `llama_decode` does not cover: new tokens (b, steps) and their raw
    log-probs (b, steps)."""
    res = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
        pad_token_id=pad_id, eos_token_id=stop_ids, return_dict_in_generate=True,
        output_logits=sampler is None, disable_compile=True, **cache_arg(cache), **kwargs,
    )
    new = res.sequences[:, ids.shape[1]:]
    # Log-prob of each sampled token under the raw (unprocessed) logits: kept by the seeded
    # sampler as it goes; otherwise from HF's per-step logits, one (b, V) step at a time.
    lp = sampler.token_logprobs(new) if sampler is not None else torch.stack(
        [torch.log_softmax(step.float(), dim=-1).gather(-1, tok[:, None])[:, 0]
         for step, tok in zip(res.logits, new.unbind(1), strict=True)], dim=1)
    return new, lp


def eos_ids(model: Any, tokenizer: Any) -> list[int]:
    """Token ids that end a generation: the tokenizer's EOS and the generation config's."""
    ids = {tokenizer.eos_token_id}
    cfg_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(cfg_eos, int):
        ids.add(cfg_eos)
    elif isinstance(cfg_eos, list):
        ids.update(cfg_eos)
    return sorted(i for i in ids if i is not None)
