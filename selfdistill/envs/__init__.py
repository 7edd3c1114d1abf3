"""Feedback environments: where the world answers back.

- `CodeEnv`: unit tests run in an isolated sandbox; judge-style feedback (kinds `test_failure`,
  `runtime_error`, `syntax_error`, `timeout`, ...). Sandbox: `selfdistill.envs.sandbox`.
- `QAEnv`: a reference answer; feedback reveals it (`ground_truth`) or only says "Incorrect.".
- `ConversationEnv`: the user's next message (`user_followup`); loaders for triplets and chat logs.

`make_env(row)` picks one from a row's columns; `step_many` steps many envs in parallel.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from selfdistill.data import Row
from selfdistill.envs.base import FEEDBACK_KINDS, Env, Feedback, step_many
from selfdistill.envs.code import CodeEnv, CodeProblem, extract_code, load_code_problems
from selfdistill.envs.conversation import (
    ConversationEnv,
    FollowupExample,
    example_from_triplet,
    examples_from_chat,
    load_followups,
)
from selfdistill.envs.qa import QAEnv
from selfdistill.envs.sandbox import Job, Limits, RunResult, Sandbox, SandboxUnavailable
from selfdistill.errors import UserError

__all__ = [
    "FEEDBACK_KINDS",
    "CodeEnv",
    "CodeProblem",
    "ConversationEnv",
    "Env",
    "Feedback",
    "FollowupExample",
    "Job",
    "Limits",
    "QAEnv",
    "RunResult",
    "Sandbox",
    "SandboxUnavailable",
    "example_from_triplet",
    "examples_from_chat",
    "extract_code",
    "load_code_problems",
    "load_followups",
    "make_env",
    "step_many",
]


def make_env(
    row: Row | Mapping[str, Any],
    *,
    sandbox: Sandbox | None = None,
    reveal: bool = True,
    max_feedback_chars: int = 2000,
) -> Env:
    """The environment a row's columns call for: 'tests' → CodeEnv, 'followup' →
    ConversationEnv, 'answer' → QAEnv. `row` is a raw JSONL object or a `data.Row`."""
    if isinstance(row, Row):
        obj: dict[str, Any] = {**row.extra, "prompt": row.messages}
        if row.answers:
            obj["answer"] = row.answers
        source = row.source
    else:
        obj, source = dict(row), "row"
    try:
        if "tests" in obj:
            problem = CodeProblem.from_dict(obj, source)
            return CodeEnv(problem, sandbox=sandbox, max_feedback_chars=max_feedback_chars)
        if "followup" in obj:
            return ConversationEnv(example_from_triplet(obj, source))
        if "answer" in obj:
            return QAEnv(obj.get("prompt") or obj["messages"], obj["answer"], reveal=reveal)
    except (ValueError, KeyError) as exc:
        raise UserError(f"{source}: {exc}") from None
    raise UserError(
        f"{source}: no environment fits this row: it needs 'tests' (code), "
        f"'followup' (conversation) or 'answer' (QA); it has {sorted(obj)}"
    )
