"""Text out of the engine's tokens: incremental detokenization for streaming, stop strings, the
finish reason, and the log-prob records both APIs report."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from selfdistill.serve.engine import Engine, Token


@dataclass
class Piece:
    """Text that became final with `token` (may be empty while a character is incomplete or a
    stop string might be starting)."""

    text: str
    token: Token


@dataclass
class Generation:
    """One completion being produced: iterate for `Piece`s; afterwards `text`, `tokens` and
    `finish_reason` ("stop": EOS or a stop string; "length": max_tokens) are final."""

    engine: Engine
    prompt_ids: list[int]
    adapter: str | None
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_logprobs: int = 0
    stops: list[str] = field(default_factory=list)
    text: str = ""
    tokens: list[Token] = field(default_factory=list)
    finish_reason: str = "length"

    def __iter__(self) -> Iterator[Piece]:
        tok = self.engine.tokenizer
        hold = max((len(s) for s in self.stops), default=1) - 1
        sent = 0
        content: list[int] = []
        for token in self.engine.decode(
            self.prompt_ids,
            self.adapter,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
            top_logprobs=self.top_logprobs,
        ):
            self.tokens.append(token)
            eos = token.id in self.engine.eos_ids
            if not eos:
                content.append(token.id)
            text = tok.decode(content, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
            if cut >= 0 or eos:
                self.finish_reason = "stop"
                self.text = text[:cut] if cut >= 0 else text
                yield Piece(self.text[sent:], token)
                return
            self.text = text
            ready = len(text) - hold
            if text.endswith("\ufffd"):  # an incomplete multi-byte character
                ready = min(ready, len(text) - 1)
            if ready > sent:
                yield Piece(text[sent:ready], token)
                sent = ready
            else:
                yield Piece("", token)
        if sent < len(self.text):  # the held-back tail, at max_tokens
            yield Piece(self.text[sent:], self.tokens[-1])

    def run(self) -> Generation:
        """Produce everything (non-streaming)."""
        for _ in self:
            pass
        return self


def token_str(tokenizer: Any, token_id: int, as_ids: bool = False) -> str:
    """How a token is shown in log-prob records: its text, or ``token_id:N`` (vLLM's
    `return_tokens_as_token_ids`)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def chat_logprobs(tokenizer: Any, tokens: list[Token]) -> dict[str, Any]:
    """The chat API's `choices[].logprobs`: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(tid: int, lp: float) -> dict[str, Any]:
        s = tokenizer.decode([tid])
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {
        "content": [
            {**entry(t.id, t.logprob), "top_logprobs": [entry(i, v) for i, v in t.top.items()]}
            for t in tokens
        ]
    }
