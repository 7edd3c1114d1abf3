"""Keys and values of teacher prompts, computed once while the teacher's weights are frozen.

With `teacher.regime=base` (or `model`) the teacher never changes and every step re-reads the
same prompts: a task row's question with its privileged context (~70 tokens on the main job),
an anchor's question (~38). Those prompts are known before training (`warm`), so their keys
and values are computed once, in a few batched forwards, and a step's teacher forward runs over
each row's last prompt token and its completion only (~21 columns per row on the main job
instead of ~60–100). Prompts that change every step (SDPO feedback) are not cached; the caller
runs them in full.

Exactness. `warm` is deterministic (the prompts in a fixed order, fixed batches), so a resumed
run rebuilds bit-identical entries; an entry equals what the step's own padded forward computes
for those positions up to float rounding (tested). Computing them up front also keeps these
long-lived tensors out of the middle of the heap, where small survivors between a step's large
temporaries would fragment it.

Layout, for a batch packed by `build_batch` (prompts left-padded to width P): the assembled cache
covers columns 0 … P−2, row i's entry (its prompt without the last token) right-aligned to end
at column P−2 and zeros before it, where the attention mask is 0 anyway. The forward then
feeds columns P−1 … P+T−1 (`model_logits(prefix_width=P−1, cache=...)`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from selfdistill.teacher.scoring import build_batch

Entry = list[tuple[Tensor, Tensor]]  # per layer: keys, values of shape (heads, n, head_dim)


class PromptCache:
    """Per-prompt keys/values of a frozen teacher, at most `max_bytes` of them.

    A model whose cache is not one plain key/value tensor pair per layer (sliding-window or
    linear-attention layers) caches nothing; `supported` then reads False.
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.entries: dict[tuple[int, ...], Entry] = {}
        self.bytes = 0
        self.supported = True

    def __contains__(self, prompt: list[int]) -> bool:
        return tuple(prompt[:-1]) in self.entries

    def warm(self, regime: Any, model: Any, prompts: list[list[int]], pad_id: int,
             batch_size: int = 16) -> None:
        """Compute the entries of `prompts` (each without its last token; duplicates and
        one-token prompts skipped) in length-sorted batches, until `max_bytes` is reached."""
        from transformers.cache_utils import DynamicLayer

        todo = sorted({tuple(p[:-1]) for p in prompts if len(p) > 1} - self.entries.keys(),
                      key=lambda ids: (len(ids), ids))
        device = next(model.parameters()).device
        for start in range(0, len(todo), batch_size):
            chunk = [list(ids) for ids in todo[start:start + batch_size]]
            b = build_batch(chunk, [[pad_id]] * len(chunk), pad_id, device=device)
            width = b.prompt_width
            cache = regime.prompt_kv(model, b.input_ids[:, :width], b.attention_mask[:, :width],
                                     b.position_ids[:, :width])
            if not all(type(layer) is DynamicLayer for layer in cache.layers):
                self.supported = False
                return
            size = sum(layer.keys.numel() * layer.keys.element_size() * 2
                       for layer in cache.layers)
            if self.bytes + size > self.max_bytes:
                return
            self.bytes += size
            for i, ids in enumerate(chunk):  # views into the batch's tensors: no copies
                self.entries[tuple(ids)] = [
                    (layer.keys[i, :, width - len(ids):].detach(),
                     layer.values[i, :, width - len(ids):].detach()) for layer in cache.layers]

    def assemble(self, prompts: list[list[int]]) -> tuple[Any, int]:
        """(cache, width): an HF cache of `prompts` (all in the cache) without their last
        token, laid out as the first `width` = P − 1 columns of `build_batch(prompts, ...)`
        (module docstring)."""
        from transformers import DynamicCache

        width = max(map(len, prompts)) - 1
        entries = [self.entries[tuple(p[:-1])] for p in prompts]
        layers = []
        for layer in range(len(entries[0])):
            heads, _, dim = entries[0][layer][0].shape
            keys = entries[0][layer][0].new_zeros((len(prompts), heads, width, dim))
            values = torch.zeros_like(keys)
            for i, entry in enumerate(entries):
                k, v = entry[layer]
                keys[i, :, width - k.shape[1]:] = k
                values[i, :, width - v.shape[1]:] = v
            layers.append((keys, values))
        return DynamicCache(layers), width

