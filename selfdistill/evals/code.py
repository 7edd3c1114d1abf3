"""Pass rate of code problems: a greedy answer is correct when its code passes every unit test.

Rows carrying `tests` (the row format of `selfdistill.envs.code`) are judged by `CodeEnv` in the
sandbox; any other row of the same suite keeps the strict string match of `evaluate`. The
row's `reference` solution is never shown to the model: prompts are the row's messages only.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from selfdistill.data import Row
from selfdistill.envs import make_env, step_many
from selfdistill.evals.accuracy import EvalReport, evaluate


def has_tests(row: Row) -> bool:
    """Whether the row is a code problem judged by unit tests."""
    return "tests" in row.extra


def evaluate_code(model: Any, tokenizer: Any, rows: list[Row], **kwargs: Any) -> EvalReport:
    """`evaluate` (same arguments: greedy answers), with rows that carry `tests` scored by
    whether the answer's code passes all of them."""
    report = evaluate(model, tokenizer, rows, **kwargs)
    coded = [i for i, r in enumerate(rows) if has_tests(r)]
    feedback = step_many([make_env(rows[i]) for i in coded],
                         [report.items[i].completion for i in coded])
    items = list(report.items)
    for i, fb in zip(coded, feedback, strict=True):
        items[i] = replace(items[i], correct=fb.passed)
    accuracy = sum(i.correct for i in items) / len(items) if items else 0.0
    return EvalReport(accuracy, len(items), items)
