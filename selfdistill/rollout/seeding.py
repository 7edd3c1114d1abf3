"""Sampling that does not depend on how a batch is split: one random stream per sample.

`torch.multinomial` inside HF `generate` draws from one global generator, so the tokens a prompt
gets depend on which other prompts share its batch and in which order — two ranks holding half a
batch each would sample different tokens than one process holding all of it. Here every sample
owns a generator seeded by `sample_seed(seed, step, stream, index)` (its *global* position in the
step's batch), and a token is drawn by the Gumbel-max trick:

    y_t = argmax_v ( log_softmax(z_t / temperature)_v [top-p filtered] + G_{t,v} ),
    G_{t,v} = −log(−log U_{t,v}),  U ~ Uniform(0, 1) from the sample's own generator,

which is an exact draw from the temperature / top-p distribution (Gumbel-max). Row b's t-th draw
is the t-th call of its generator, whatever the batch around it.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import LogitsProcessor, TopPLogitsWarper

TASK_STREAM = 0
"""`stream` of the task prompts' samples (`sample_seed`)."""
ANCHOR_STREAM = 1
"""`stream` of the anchor prompts' samples."""
BASE_ANCHOR_STREAM = 2
"""`stream` of the base model's anchor samples (`anchor_source=base`; index = anchor row)."""


def sample_seed(seed: int, step: int, stream: int, index: int) -> int:
    """A 63-bit seed that is a pure function of (run seed, step, stream, global sample index).

    Uses numpy's SeedSequence (hash-mixing), so nearby tuples give unrelated streams.
    """
    words = np.random.SeedSequence([seed % 2**63, step, stream, index]).generate_state(2)
    return int((int(words[0]) << 32 | int(words[1])) & (2**63 - 1))


class GumbelSampler(LogitsProcessor):
    """A logits processor that turns greedy decoding into seeded sampling (see module docstring).

    Use with `generate(do_sample=False)`: it applies temperature and top-p itself, then adds
    per-row Gumbel noise, so the argmax HF takes is a sample. `seeds[b]` seeds row b.
    It also keeps what `token_logprobs` needs — the log-prob of each sampled token under the
    raw (temperature 1, unfiltered) distribution — read off `input_ids` at the next call, so
    `generate` need not return every step's (B, V) logits (`output_logits`: 100 MB for 8 rows
    × 64 tokens of a 49k vocabulary, held until the call ends).
    """

    def __init__(self, seeds: list[int], *, temperature: float = 1.0, top_p: float = 1.0) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.generators = [torch.Generator().manual_seed(s) for s in seeds]
        self.temperature = temperature
        self.top_p = TopPLogitsWarper(top_p) if top_p < 1.0 else None
        self._raw: torch.Tensor | None = None  # the last call's raw log-probs, (B, V)
        self._taken: list[torch.Tensor] = []  # raw log-prob of each earlier step's token, (B,)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        """scores: (B, V) next-token logits → (B, V) perturbed log-probs (argmax = a sample)."""
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"GumbelSampler has {len(self.generators)} seeds, batch has "
                             f"{scores.shape[0]} rows")
        raw = torch.log_softmax(scores.float(), dim=-1)
        if self._raw is not None:  # input_ids now ends with the token the last call sampled
            self._taken.append(self._raw.gather(-1, input_ids[:, -1:].to(raw.device))[:, 0])
        self._raw = raw
        logp = raw if self.temperature == 1.0 else torch.log_softmax(
            scores.float() / self.temperature, dim=-1)
        if self.top_p is not None:
            logp = self.top_p(input_ids, logp)
        u = torch.stack([torch.rand(scores.shape[-1], generator=g, dtype=torch.float64)
                         for g in self.generators]).to(scores.device)
        # G = −log(−log u), in place on the (B, V) float64 buffer: the same values as the
        # out-of-place expression without four fresh (B, V) temporaries per decode step.
        gumbel = u.clamp_(1e-300, 1.0 - 1e-16).log_().neg_().log_().neg_()
        return gumbel.add_(logp).to(scores.dtype)

    def token_logprobs(self, tokens: torch.Tensor) -> torch.Tensor:
        """(B, steps) sampled tokens (this sampler's calls, in order) → (B, steps) float32
        log π(token) under each step's raw distribution, in nats."""
        if self._raw is None or len(self._taken) != tokens.shape[1] - 1:
            raise ValueError(f"GumbelSampler saw {len(self._taken) + (self._raw is not None)} "
                             f"decode steps, got {tokens.shape[1]} tokens")
        last = self._raw.gather(-1, tokens[:, -1:].to(self._raw.device))[:, 0]
        return torch.stack([*self._taken, last], dim=1)
