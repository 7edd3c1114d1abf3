"""What every environment returns: `Feedback`, and the `Env` interface.

An environment is one episode: it holds a task (the chat `messages` the student answers) and
judges one completion with `step(completion) -> Feedback`. The feedback `text` is what the teacher
reads as privileged context, so it says *why* (the failing input, the exception and its line, the
expected answer, the user's reply), not only *whether*.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol, runtime_checkable

from selfdistill.chat import Message

# Feedback kinds (DESIGN.md vocabulary first, then the code judge's finer verdicts).
FEEDBACK_KINDS = (
    "test_failure",  # wrong answer on a unit test
    "runtime_error",  # an exception, or the process died
    "ground_truth",  # the reference answer, revealed
    "user_followup",  # the user's next message
    "verdict",  # correct / incorrect only (QA with reveal=False)
    "tests_passed",  # every unit test passed
    "syntax_error",
    "timeout",
    "memory_limit",
    "output_limit",
    "missing_entry_point",
    "no_code",  # the answer holds no code to run
)


@dataclass(frozen=True)
class Feedback:
    """The world's answer to one completion."""

    reward: float  # in [0, 1]: fraction of tests passed, 1/0 for QA; 0 where there is no score
    text: str  # for the teacher's context: why, not only whether
    kind: str  # one of FEEDBACK_KINDS
    passed: bool  # the completion needs no correction (False where unknown)
    evidence: dict[str, Any] = field(default_factory=dict)  # machine-readable, for traces

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (the trace store's form)."""
        return asdict(self)


@runtime_checkable
class Env(Protocol):
    """One episode: `messages` is the task, `step` judges one completion of it."""

    messages: list[Message]

    def step(self, completion: str) -> Feedback:
        """Judge `completion`; never raises for anything the completion contains."""
        ...


def clip(text: str, limit: int, marker: str = "... (truncated)") -> str:
    """`text` cut to at most `limit` characters, saying so when it was cut."""
    if limit <= 0 or len(text) <= limit:
        return text
    return text[: max(0, limit - len(marker))] + marker


def step_many(
    envs: Sequence[Env], completions: Sequence[str], workers: int | None = None
) -> list[Feedback]:
    """`env.step(completion)` for each pair, in parallel threads (default: one per CPU core).

    Code environments spend their time waiting on a sandboxed process, so threads suffice.
    """
    if len(envs) != len(completions):
        raise ValueError(f"{len(envs)} environments but {len(completions)} completions")
    if not envs:
        return []
    workers = max(1, min(workers or os.cpu_count() or 1, len(envs)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(
            pool.map(lambda pair: pair[0].step(pair[1]), zip(envs, completions, strict=True))
        )
