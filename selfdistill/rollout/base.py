"""Generation backends for training rollouts: one interface, two engines.

- `HFSampler` (default): in-process HF `generate` on the learner's own weights — never lags.
- `ServerSampler` (`rollout.server`): an OpenAI-compatible completions server with token
  log-probs and dynamic LoRA loading (`vllm serve --enable-lora`, or `selfdistill serve`); the
  learner pushes its adapter every `push_every` steps, so samples may come from an older version.

Versions are learner steps: a completion's `meta["adapter_version"]` is the step whose weights
sampled it; `lag = step − adapter_version` is what the importance-ratio correction covers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from selfdistill.rollout.hf import Completion, eos_ids, generate


class Sampler(ABC):
    """What the trainer asks of a generation backend."""

    version: int = 0
    """Learner step whose weights the next samples come from."""

    def sync(self, model: Any, step: int, dist: Any = None) -> None:  # noqa: B027 (optional)
        """Called on every rank before step `step`'s rollouts: make generation follow the
        learner (or not yet, for a backend that lags by design). `dist` (`train.dist.Dist`):
        only its main rank uploads; the others learn which version is in use."""

    @abstractmethod
    def sample(self, prompts: list[list[int]], *, n: int, max_new_tokens: int,
               temperature: float, top_p: float, seeds: list[int]) -> list[list[Completion]]:
        """`n` completions per prompt (token ids, already chat-templated); `seeds[i * n + j]`
        fixes prompt i's j-th completion. Each completion carries its token log-probs and
        `meta["adapter_version"]`."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections / files."""


class HFSampler(Sampler):
    """In-process generation with the learner's current weights (`rollout.hf.generate`)."""

    def __init__(self, model: Any, tokenizer: Any, **decoding: bool) -> None:
        """`decoding`: `generate`'s decoding switches (fold_lora, pack_weights, decode_loop)."""
        self.model, self.tokenizer, self.decoding = model, tokenizer, decoding

    @classmethod
    def from_config(cls, rollout: Any, model: Any, tokenizer: Any) -> HFSampler:
        """The sampler a `rollout` config section (`train.config.RolloutConfig`) asks for."""
        return cls(model, tokenizer, fold_lora=rollout.fold_lora,
                   pack_weights=rollout.pack_weights, decode_loop=rollout.decode_loop)

    def sync(self, model: Any, step: int, dist: Any = None) -> None:
        self.model, self.version = model, step

    def sample(self, prompts: list[list[int]], *, n: int, max_new_tokens: int,
               temperature: float, top_p: float, seeds: list[int]) -> list[list[Completion]]:
        if not prompts:
            return []
        groups = generate(self.model, self.tokenizer, prompts, n=n, max_new_tokens=max_new_tokens,
                          temperature=temperature, top_p=top_p, batch_size=len(prompts) * n,
                          seeds=seeds, **self.decoding)
        for group in groups:
            for c in group:
                c.meta["adapter_version"] = self.version
        return groups


def make_sampler(rollout: Any, model: Any, tokenizer: Any, run_dir: str | Path) -> Sampler:
    """The backend a `rollout` config section (`train.config.RolloutConfig`) names; pushed
    adapters go to `rollout.push_dir`, else `run_dir/pushed`."""
    if rollout.backend == "hf":
        return HFSampler.from_config(rollout, model, tokenizer)
    from selfdistill.rollout.server import ServerSampler

    return ServerSampler(rollout.url, tokenizer,
                         push_dir=Path(rollout.push_dir or Path(run_dir) / "pushed").resolve(),
                         push_every=rollout.push_every, adapter_name=rollout.adapter_name,
                         timeout=rollout.timeout, concurrency=rollout.concurrency,
                         stop_ids=eos_ids(model, tokenizer))
