"""JSONL datasets: reading, validating and typing rows.

Row formats (README "Data formats"):
- evaluation row: `{"prompt": str | [messages], "answer": str | [str, ...]}`; a completion is
  correct when any answer string occurs in it, case-insensitively.
- demonstration row: `{"prompt": ..., "privileged_context": str, "context_kind"?: str,
  "answer"?: ...}`; `context_kind` says how the teacher is shown the context (a kind of
  `selfdistill.teacher.KINDS`: "demonstration", the default, is an example response; "fact" is
  background knowledge the answer needs; "system_prompt" becomes the teacher's system message,
  "instructions" standing instructions in the user turn).
- a row may carry `"rule": {...}` (see `selfdistill.rules`): a format check; where an `answer`
  is required, a `rule` may take its place, and a row with a rule is correct when its
  completion follows the rule (and contains an answer, if it also has one).
A plain-string prompt means one user message. Every problem is reported with file and line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selfdistill.chat import ROLES, Message, to_messages
from selfdistill.errors import DataError
from selfdistill.rules import Rule, follows_rule, parse_rule
from selfdistill.teacher.contexts import KINDS


@dataclass
class Row:
    """One dataset row, validated. `extra` keeps the columns this module does not interpret."""

    messages: list[Message]
    answers: list[str] = field(default_factory=list)
    privileged_context: str | None = None
    context_kind: str = "demonstration"  # how the teacher sees privileged_context
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = ""  # "file:line", for error messages and traces
    rule: Rule | None = None  # a format check (see selfdistill.rules)


def read_jsonl(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """Parse a JSONL file into (line number, object) pairs; blank lines are allowed."""
    path = Path(path)
    if not path.is_file():
        raise DataError(path, None, "no such file")
    rows = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(
                    path, lineno, f"malformed JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise DataError(path, lineno, f"expected a JSON object, got {type(obj).__name__}")
            rows.append((lineno, obj))
    if not rows:
        raise DataError(path, None, "file is empty: expected one JSON object per line")
    return rows


def _check_prompt(path: Path, lineno: int, prompt: Any) -> list[Message]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise DataError(path, lineno, "'prompt' is an empty string")
        return to_messages(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise DataError(path, lineno, "'prompt' must be a string or a non-empty list of "
                        f"chat messages, got {type(prompt).__name__}")
    for i, m in enumerate(prompt):
        if not (isinstance(m, dict) and isinstance(m.get("content"), str)
                and m.get("role") in ROLES):
            raise DataError(path, lineno, f"'prompt'[{i}] must be {{'role': one of {ROLES}, "
                            f"'content': str}}, got {json.dumps(m)[:80]}")
    if prompt[-1]["role"] != "user":
        raise DataError(path, lineno, "the last prompt message must have role 'user'")
    return to_messages(prompt)


def _check_answers(path: Path, lineno: int, answer: Any) -> list[str]:
    answers = [answer] if isinstance(answer, str) else answer
    if (not isinstance(answers, list) or not answers
            or not all(isinstance(a, str) and a.strip() for a in answers)):
        raise DataError(path, lineno, "'answer' must be a non-empty string or a non-empty list "
                        "of non-empty strings")
    return answers


def load_rows(
    path: str | Path, *, require: tuple[str, ...] = ("prompt",), purpose: str = "dataset"
) -> list[Row]:
    """Load and validate a JSONL file. `require` lists the columns every row must have
    (e.g. ("prompt", "answer") for evaluation, ("prompt", "privileged_context") for SDFT)."""
    path = Path(path)
    out = []
    for lineno, obj in read_jsonl(path):
        for col in require:
            if col not in obj and not (col == "answer" and "rule" in obj):
                raise DataError(path, lineno, f"missing '{col}' (a {purpose} row needs "
                                f"{', '.join(repr(c) for c in require)})")
        if "prompt" not in obj:
            raise DataError(path, lineno, "missing 'prompt'")
        messages = _check_prompt(path, lineno, obj["prompt"])
        answers = _check_answers(path, lineno, obj["answer"]) if "answer" in obj else []
        ctx = obj.get("privileged_context")
        if ctx is not None and (not isinstance(ctx, str) or not ctx.strip()):
            raise DataError(path, lineno, "'privileged_context' must be a non-empty string")
        kind = obj.get("context_kind", "demonstration")
        if kind not in KINDS:
            raise DataError(path, lineno, f"'context_kind' must be one of {', '.join(KINDS)}, "
                            f"got {json.dumps(kind)[:40]}")
        try:
            rule = parse_rule(obj["rule"]) if "rule" in obj else None
        except ValueError as exc:
            raise DataError(path, lineno, str(exc)) from None
        extra = {k: v for k, v in obj.items()
                 if k not in {"prompt", "answer", "privileged_context", "context_kind", "rule"}}
        out.append(Row(messages, answers, ctx, kind, extra, source=f"{path}:{lineno}",
                       rule=rule))
    return out


def is_correct(completion: str, answers: list[str]) -> bool:
    """Strict scoring: any reference answer occurs in the completion, case-insensitively."""
    low = completion.lower()
    return any(a.lower() in low for a in answers)


def row_correct(row: Row, completion: str) -> bool:
    """A row's own check: its `rule` (and its answers, when it has both), else `is_correct`."""
    if row.rule is not None and not follows_rule(completion, row.rule):
        return False
    return not row.answers or is_correct(completion, row.answers)


def is_graded(row: Row) -> bool:
    """Whether `row_correct` can score this row (it has an answer or a rule)."""
    return bool(row.answers) or row.rule is not None
