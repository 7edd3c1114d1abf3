"""The serving engine: one base model, any number of LoRA adapters loaded side by side, and a
token-by-token decoder whose steps from concurrent requests interleave under one lock.

Hot swap without breaking in-flight requests: a request pins its adapter when it starts
(`Engine.pin`); every decoding step selects that adapter under the lock, so a promotion (a new
adapter loaded for new requests) or an unload (deferred while the adapter is pinned) never changes
the weights a running request decodes with. Adapters are PEFT LoRA adapters named by their
registry version id (or by the name a `load_lora_adapter` call gave); the base model is served
with the adapter layers disabled.

Log-probs are those of the raw model distribution (temperature 1, no top-p), in nats, as vLLM
reports them by default (`logprobs_mode=raw_logprobs`) and as `selfdistill.rollout` records them.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from selfdistill.models import cache_arg, output_cache
from selfdistill.rollout.hf import eos_ids

T = TypeVar("T")


@dataclass
class Token:
    """One decoded token: its id, its raw log-prob (nats) and the top-k alternatives (id → lp)."""

    id: int
    logprob: float
    top: dict[int, float] = field(default_factory=dict)


def sample_token(
    logits_V: torch.Tensor,
    *,
    temperature: float,
    top_p: float,
    generator: torch.Generator | None,
    top_logprobs: int = 0,
) -> Token:
    """Draw the next token from float32 logits (V,).

    Sampling distribution: softmax(logits / temperature) restricted to the smallest set of
    tokens whose mass reaches `top_p` (renormalized); temperature 0 = argmax. The returned
    `logprob` is log softmax(logits)[token], the raw distribution's, whatever the sampler did.
    """
    raw = torch.log_softmax(logits_V.float(), dim=-1)  # (V,)
    if temperature <= 0:
        tok = int(torch.argmax(raw))
    else:
        probs = torch.softmax(logits_V.float() / temperature, dim=-1)
        if top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < top_p  # always keeps the first
            filtered = torch.zeros_like(probs)
            filtered[order[keep]] = sorted_p[keep]
            probs = filtered / filtered.sum()
        tok = int(torch.multinomial(probs, 1, generator=generator))
    top: dict[int, float] = {}
    if top_logprobs > 0:
        values, ids = torch.topk(raw, top_logprobs)
        top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
    return Token(tok, float(raw[tok]), top)


class UnknownAdapter(LookupError):
    """The adapter name is not loaded (or was unloaded)."""


class Engine:
    """A base model plus named LoRA adapters; all model use goes through `lock`."""

    def __init__(self, model: Any, tokenizer: Any, *, name: str, path: str) -> None:
        self.model, self.tokenizer, self.name, self.path = model, tokenizer, name, path
        self.lock = threading.RLock()
        self.adapters: dict[str, Path] = {}  # loaded name → directory
        self._pins: Counter[str] = Counter()
        self._retired: set[str] = set()  # unloaded while pinned: deleted at the last unpin
        self._selected: str | None = None
        self.device = next(model.parameters()).device
        self.eos_ids = set(eos_ids(model, tokenizer))

    # -- adapters --------------------------------------------------------------------------------

    def load(self, name: str, path: str | Path) -> bool:
        """Load the adapter directory `path` as `name` (no-op if loaded). True if it was loaded
        now. Raises the loader's error for a directory that is not a PEFT adapter."""
        from peft import PeftModel

        with self.lock:
            if name in self.adapters and name not in self._retired:
                return False
            if name in self._retired:  # reloaded before its last in-flight request finished
                self._retired.discard(name)
                return True
            if isinstance(self.model, PeftModel) and name in self.model.peft_config:
                pass  # the idle last adapter (see `_delete`), loaded again
            elif isinstance(self.model, PeftModel):
                self.model.load_adapter(str(path), adapter_name=name, is_trainable=False)
            else:
                self.model = PeftModel.from_pretrained(
                    self.model, str(path), adapter_name=name, is_trainable=False
                )
            self.model.eval()
            self.adapters[name] = Path(path)
            self._selected = "?"  # loading may change the active adapter
            return True

    def unload(self, name: str) -> None:
        """Stop serving `name`: new requests cannot use it; running ones finish with it."""
        with self.lock:
            if name not in self.adapters or name in self._retired:
                raise UnknownAdapter(name)
            self._retired.add(name)
            if self._pins[name] == 0:
                self._delete(name)

    def _delete(self, name: str) -> None:
        self._retired.discard(name)
        self.adapters.pop(name)
        if len(self.model.peft_config) > 1:  # PEFT cannot delete its last adapter: it stays idle
            if self.model.active_adapter == name:
                self.model.set_adapter(next(n for n in self.model.peft_config if n != name))
            self.model.delete_adapter(name)
        self._selected = "?"

    def has(self, name: str) -> bool:
        """Whether new requests may use adapter `name`."""
        with self.lock:
            return name in self.adapters and name not in self._retired

    @contextmanager
    def pin(self, name: str | None) -> Iterator[None]:
        """Hold adapter `name` (None = the base) for one request; an unload waits for it."""
        with self.lock:
            if name is not None and not self.has(name):
                raise UnknownAdapter(name)
            if name is not None:
                self._pins[name] += 1
        try:
            yield
        finally:
            if name is not None:
                with self.lock:
                    self._pins[name] -= 1
                    if self._pins[name] == 0 and name in self._retired:
                        self._delete(name)

    def _select(self, name: str | None) -> None:
        """Under the lock: make `name` (None = base) the weights of the next forward."""
        if self._selected == name:
            return
        if hasattr(self.model, "peft_config"):
            lora = self.model.base_model
            if name is None or name not in self.model.peft_config:
                lora.disable_adapter_layers()
            else:
                lora.enable_adapter_layers()
                self.model.set_adapter(name)
        self._selected = name

    def run(self, adapter: str | None, fn: Callable[[Any], T]) -> T:
        """`fn(model)` under the lock with `adapter` selected and gradients off."""
        with self.lock, torch.no_grad():
            self._select(adapter)
            return fn(self.model)

    # -- decoding --------------------------------------------------------------------------------

    def decode(
        self,
        prompt_ids: list[int],
        adapter: str | None,
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        top_logprobs: int = 0,
        stop_at_eos: bool = True,
    ) -> Iterator[Token]:
        """Yield up to `max_tokens` tokens after `prompt_ids` (EOS included, then stop). Each step
        holds the lock for one forward only; the caller must `pin` the adapter for the whole
        iteration. `seed` makes the draw reproducible (a per-request generator)."""
        gen = None if seed is None else torch.Generator().manual_seed(int(seed))
        past, feed = None, list(prompt_ids)
        for _ in range(max_tokens):
            with self.lock, torch.no_grad():
                self._select(adapter)
                out = self.model(
                    input_ids=torch.tensor([feed], device=self.device),
                    use_cache=True,
                    **cache_arg(past),
                    logits_to_keep=1,
                )
            past = output_cache(out)
            tok = sample_token(
                out.logits[0, -1].float().cpu(),
                temperature=temperature,
                top_p=top_p,
                generator=gen,
                top_logprobs=top_logprobs,
            )
            yield tok
            if stop_at_eos and tok.id in self.eos_ids:
                return
            feed = [tok.id]

    def prompt_logprobs(
        self, prompt_ids: list[int], adapter: str | None, top_logprobs: int = 0
    ) -> list[Token | None]:
        """Raw log-prob of each prompt token given the ones before it (None for the first)."""
        if len(prompt_ids) < 2:
            return [None] * len(prompt_ids)

        def forward(model: Any) -> torch.Tensor:
            ids = torch.tensor([prompt_ids], device=self.device)
            return torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1).cpu()

        lp = self.run(adapter, forward)  # (P-1, V)
        out: list[Token | None] = [None]
        for t, tok in enumerate(prompt_ids[1:]):
            top = {}
            if top_logprobs > 0:
                values, ids = torch.topk(lp[t], top_logprobs)
                top = {int(i): float(v) for i, v in zip(ids, values, strict=True)}
            out.append(Token(tok, float(lp[t, tok]), top))
        return out

