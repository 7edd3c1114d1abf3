"""Strict accuracy: greedy answers, correct when any reference string occurs (case-insensitive)
and, for rows with a `rule` (selfdistill.rules), when the answer follows the rule."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from selfdistill.chat import Message, prompt_ids
from selfdistill.data import Row, row_correct
from selfdistill.rollout import generate


@dataclass
class EvalItem:
    prompt: list[Message]
    completion: str
    answer: list[str]
    correct: bool


@dataclass
class EvalReport:
    accuracy: float  # fraction of rows answered correctly, in [0, 1]
    n: int
    items: list[EvalItem] = field(default_factory=list)

    @property
    def correct(self) -> int:
        return sum(i.correct for i in self.items)

    def to_dict(self) -> dict[str, Any]:
        return {"accuracy": self.accuracy, "n": self.n, "correct": self.correct,
                "items": [asdict(i) for i in self.items]}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2, ensure_ascii=False))


def evaluate(
    model: Any,
    tokenizer: Any,
    rows: list[Row],
    *,
    max_new_tokens: int = 64,
    batch_size: int = 16,
    messages_fn: Callable[[Row], list[Message]] | None = None,
    progress: bool = True,
    desc: str = "eval",
) -> EvalReport:
    """Greedy-answer every row and score it strictly.

    `messages_fn(row)` builds the prompt messages (default: the row's own messages); the oracle
    evaluation passes one that puts the privileged context in the prompt.
    """
    build = messages_fn or (lambda r: r.messages)
    prompts = [prompt_ids(tokenizer, build(r)) for r in rows]
    # Longest prompts first: batches then hold similar lengths, so less padding.
    order = sorted(range(len(rows)), key=lambda i: -len(prompts[i]))
    with tqdm(total=len(rows), desc=desc, disable=not progress, leave=False) as bar:
        outs = generate(model, tokenizer, [prompts[i] for i in order], greedy=True,
                        max_new_tokens=max_new_tokens, batch_size=batch_size,
                        on_batch=bar.update)
    texts = [""] * len(rows)
    for i, group in zip(order, outs, strict=True):
        texts[i] = group[0].text
    items = [EvalItem(build(r), t, r.answers, row_correct(r, t))
             for r, t in zip(rows, texts, strict=True)]
    acc = sum(i.correct for i in items) / len(items) if items else 0.0
    return EvalReport(acc, len(items), items)
