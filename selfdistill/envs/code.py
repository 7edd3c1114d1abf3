"""Code problems judged by unit tests in the sandbox, with judge-style feedback.

Row format (JSONL, one problem per line):
- function problem: `{"prompt": str | [messages], "entry_point": "fn_name",
  "tests": [{"input": [args...], "expected": value}, ...]}`; each test calls
  `fn_name(*input)` (an object `input` is passed as keyword arguments) and compares the return
  value with `expected` as JSON data (tuples count as lists, floats to 1e-6 relative).
  `entry_point` may be "Class.method" (LeetCode style: the class is built with no arguments).
- stdin/stdout program: `{"prompt": ..., "tests": [{"stdin": str, "stdout": str}, ...]}`; the
  program's output must equal `stdout` up to trailing whitespace on each line and at the end.
- optional `"reference"`: a known-good solution (tests and `selfdistill sandbox check` use it).

The completion's code is the ```python block that defines the entry point, else the last
```python block, else the last ``` block, else the whole completion. Feedback reads like a
competitive-programming judge (cf. LiveCodeBench): the verdict, then for the first failing tests
(at most 2) the exception with its line and the input that triggered it, or input / expected /
got, or which limit was hit; then "Passed k/n tests.". Reward = fraction of tests passed.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfdistill.chat import Message, to_messages
from selfdistill.data import read_jsonl
from selfdistill.envs import sandbox as sb
from selfdistill.envs.base import Feedback, clip
from selfdistill.errors import DataError

MAX_FAILURES_SHOWN = 2
_SHOW = 400  # characters of one input / expected / got / stdout shown

# Per-test verdicts → (headline, feedback kind).
_VERDICTS = {
    "passed": ("Accepted", "tests_passed"),
    "wrong_answer": ("Wrong Answer", "test_failure"),
    "runtime_error": ("Runtime Error", "runtime_error"),
    sb.TIMEOUT: ("Time Limit Exceeded", "timeout"),
    sb.MEMORY_LIMIT: ("Memory Limit Exceeded", "memory_limit"),
    sb.OUTPUT_LIMIT: ("Output Limit Exceeded", "output_limit"),
    sb.SYNTAX_ERROR: ("Syntax Error", "syntax_error"),
    sb.MISSING_ENTRY_POINT: ("Missing Function", "missing_entry_point"),
    sb.NOT_RUN: ("Not Run", "runtime_error"),
    "no_code": ("No Code", "no_code"),
}


@dataclass(frozen=True)
class CodeProblem:
    """A validated code problem (row format in the module docstring)."""

    messages: list[Message]
    tests: list[dict[str, Any]]
    entry_point: str | None = None  # None: a stdin/stdout program
    reference: str | None = None
    source: str = ""

    @classmethod
    def from_dict(
        cls, obj: dict[str, Any], source: str = "", require_prompt: bool = True
    ) -> CodeProblem:
        """Validate one row; ValueError names the problem."""
        prompt = obj.get("prompt")
        if prompt is None and require_prompt:
            raise ValueError("missing 'prompt'")
        if prompt is not None and not (
            (isinstance(prompt, str) and prompt.strip()) or (isinstance(prompt, list) and prompt)
        ):
            raise ValueError("'prompt' must be a non-empty string or list of chat messages")
        entry = obj.get("entry_point")
        if entry is not None and not (
            isinstance(entry, str) and re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)?", entry)
        ):
            raise ValueError(f"'entry_point' must be a function name, got {entry!r}")
        tests = obj.get("tests")
        if not isinstance(tests, list) or not tests:
            raise ValueError("'tests' must be a non-empty list")
        for i, test in enumerate(tests):
            _check_test(i, test, entry is not None)
        reference = obj.get("reference")
        if reference is not None and not isinstance(reference, str):
            raise ValueError("'reference' must be a string (Python source)")
        messages = to_messages(prompt) if prompt is not None else []
        return cls(messages, tests, entry, reference, source)

    def job(self, code: str) -> sb.Job:
        """The sandbox job running every test of this problem against `code`."""
        if self.entry_point is None:
            return sb.Job(code, [t.get("stdin", "") for t in self.tests])
        return sb.Job(code, [t["input"] for t in self.tests], self.entry_point)


def _check_test(i: int, test: Any, function: bool) -> None:
    if not isinstance(test, dict):
        raise ValueError(f"'tests'[{i}] must be an object")
    if function:
        if not isinstance(test.get("input"), (list, dict)) or "expected" not in test:
            raise ValueError(
                f"'tests'[{i}] must be {{'input': [args...], 'expected': value}} "
                "(a problem with 'entry_point')"
            )
    elif not isinstance(test.get("stdout"), str) or not isinstance(test.get("stdin", ""), str):
        raise ValueError(
            f"'tests'[{i}] must be {{'stdin': str, 'stdout': str}} (a problem "
            "without 'entry_point' is a stdin/stdout program)"
        )


def load_code_problems(path: str | Path) -> list[CodeProblem]:
    """Read and validate a JSONL file of code problems (DataError names file and line)."""
    out = []
    for lineno, obj in read_jsonl(path):
        try:
            out.append(CodeProblem.from_dict(obj, f"{path}:{lineno}"))
        except ValueError as exc:
            raise DataError(path, lineno, str(exc)) from None
    return out


_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def extract_code(completion: str, entry_point: str | None = None) -> str:
    """The code in a model answer (rule in the module docstring)."""
    blocks = [(lang.lower(), body) for lang, body in _FENCE.findall(completion)]
    python = [body for lang, body in blocks if lang in ("python", "py", "python3")]
    if entry_point:
        name = re.escape(entry_point.partition(".")[0])
        defining = [
            b
            for b in python or [b for _, b in blocks]
            if re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{name}\b", b, re.M)
        ]
        if defining:
            return defining[-1]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return completion


class CodeEnv:
    """One code problem; `step` runs the completion's code against all its tests."""

    def __init__(
        self,
        problem: CodeProblem,
        *,
        sandbox: sb.Sandbox | None = None,
        max_feedback_chars: int = 2000,
    ) -> None:
        self.problem = problem
        self.messages = [dict(m) for m in problem.messages]
        self.sandbox = sandbox or sb.Sandbox()
        self.max_feedback_chars = max_feedback_chars  # 0: no cap

    def step(self, completion: str) -> Feedback:
        """Extract the code, run every test in one sandbox, judge."""
        return self.check(extract_code(completion, self.problem.entry_point))

    def check(self, code: str) -> Feedback:
        """Judge a piece of code directly (no extraction)."""
        if not code.strip():
            n = len(self.problem.tests)
            text = "No Code\nThe answer contains no Python code to run."
            evidence = _evidence("no_code", ["no_code"] * n, code, None, 0.0)
            return Feedback(0.0, text, "no_code", False, evidence)
        result = self.sandbox.run(self.problem.job(code))
        return judge(self.problem, code, result, self.max_feedback_chars)


def judge(problem: CodeProblem, code: str, result: sb.RunResult, max_chars: int = 2000) -> Feedback:
    """Compare a sandbox run with the expected outputs and write the feedback."""
    verdicts = [
        _verdict(problem, test, o) for test, o in zip(problem.tests, result.outcomes, strict=True)
    ]
    n, passed = len(verdicts), verdicts.count("passed")
    failing = [i for i, v in enumerate(verdicts) if v != "passed"]
    shown = [i for i in failing if verdicts[i] != sb.NOT_RUN] or failing
    status = verdicts[failing[0]] if failing else "passed"
    headline, kind = _VERDICTS[status]
    first = result.outcomes[failing[0]] if failing else None
    if first is not None and (
        status in (sb.SYNTAX_ERROR, sb.MISSING_ENTRY_POINT) or first.detail == sb.TOP_LEVEL
    ):
        # The same failure for every test: say it once.
        body = [_whole_program_block(headline, problem, first, result.limits)]
    else:
        body = [
            _test_block(problem, i, verdicts[i], result) for i in shown[:MAX_FAILURES_SHOWN]
        ] or [headline]
    body.append(f"Passed {passed}/{n} tests.")
    evidence = _evidence(status, verdicts, code, result.isolation, result.seconds)
    return Feedback(passed / n, clip("\n\n".join(body), max_chars), kind, not failing, evidence)


def _evidence(
    status: str, verdicts: list[str], code: str, isolation: str | None, seconds: float
) -> dict[str, Any]:
    return {
        "status": status,
        "tests_passed": verdicts.count("passed"),
        "tests_total": len(verdicts),
        "test_statuses": verdicts,
        "failing_tests": [i for i, v in enumerate(verdicts) if v != "passed"],
        "code": code,
        "isolation": isolation,
        "seconds": round(seconds, 3),
    }


def _verdict(problem: CodeProblem, test: dict[str, Any], outcome: sb.TestOutcome) -> str:
    if outcome.status == sb.OK:
        if problem.entry_point is None:
            right = _norm_stdout(outcome.stdout) == _norm_stdout(test["stdout"])
        else:
            right = outcome.value_json and same_value(outcome.value, test["expected"])
        return "passed" if right else "wrong_answer"
    if outcome.status in (sb.ERROR, sb.EXITED):
        return "runtime_error"
    return outcome.status


def same_value(got: Any, expected: Any) -> bool:
    """JSON-data equality; floats to 1e-6 relative (1e-9 absolute); bools are not numbers."""
    if isinstance(got, bool) or isinstance(expected, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(got, (int, float)) and isinstance(expected, (int, float)):
        if isinstance(got, int) and isinstance(expected, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=1e-6, abs_tol=1e-9)
    if isinstance(got, list) and isinstance(expected, list):
        return len(got) == len(expected) and all(map(same_value, got, expected))
    if isinstance(got, dict) and isinstance(expected, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k]) for k in got)
    return type(got) is type(expected) and got == expected


def _norm_stdout(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


def _show(value: Any) -> str:
    return clip(json.dumps(value, separators=(",", ":"), ensure_ascii=False), _SHOW)


def _shown_input(problem: CodeProblem, i: int) -> str:
    test = problem.tests[i]
    return _show(test["input"]) if problem.entry_point else _show_text(test.get("stdin", ""))


def _show_text(text: str) -> str:
    return clip(text.rstrip("\n"), _SHOW)


def _test_block(problem: CodeProblem, i: int, verdict: str, result: sb.RunResult) -> str:
    o, limits = result.outcomes[i], result.limits
    headline = _VERDICTS[verdict][0]
    last_input = f"Last Executed Input\n{_shown_input(problem, i)}"
    if verdict == "wrong_answer":
        if problem.entry_point is None:
            expected, got = _show_text(problem.tests[i]["stdout"]), _show_text(o.stdout)
        else:
            expected = _show(problem.tests[i]["expected"])
            got = _show(o.value) if o.value_json else clip(o.value_repr, _SHOW)
        lines = [
            headline,
            f"Input\n{_shown_input(problem, i)}",
            f"Expected\n{expected}",
            f"Got\n{got}",
        ]
        if problem.entry_point and o.stdout.strip():
            lines.append(f"Stdout\n{_show_text(o.stdout)}")
        return "\n".join(lines)
    if o.error and verdict in ("runtime_error", sb.MEMORY_LIMIT):
        lines = [headline, _exception_line(o.error)]
        if verdict == sb.MEMORY_LIMIT:
            lines[1] += f" (limit: {limits.memory_mb} MiB of address space per process)"
        if o.error.get("line"):
            lines.append(
                f"Line {o.error['line']} in {o.error.get('function') or '<module>'} "
                f"({sb.SOLUTION_NAME})"
            )
        return "\n".join([*lines, last_input])
    detail = o.detail or "the test did not complete"
    if verdict == sb.TIMEOUT and "wall clock" in detail:
        detail = f"Test {i + 1} {detail}"
    lines = [headline, detail[0].upper() + detail[1:]]
    if verdict == "runtime_error" and o.stderr.strip():
        lines.append(f"Stderr (end)\n{o.stderr.strip()[-_SHOW:]}")
    return "\n".join([*lines, last_input])


def _exception_line(error: dict[str, Any]) -> str:
    message = clip(str(error.get("message", "")), _SHOW)
    return f"{error.get('type')}: {message}" if message else str(error.get("type"))


def _whole_program_block(
    headline: str, problem: CodeProblem, o: sb.TestOutcome, limits: sb.Limits
) -> str:
    error = o.error or {}
    if o.status == sb.SYNTAX_ERROR:
        lines = [headline, _exception_line(error)]
        if error.get("line"):
            lines.append(f"Line {error['line']} ({sb.SOLUTION_NAME})")
        text = str(error.get("text") or "")
        if text.strip():
            lines.append("    " + text.strip("\n"))
            if error.get("offset"):
                indent = len(text) - len(text.lstrip())
                lines.append("    " + " " * max(0, error["offset"] - 1 - indent) + "^")
        return "\n".join(lines)
    if o.status == sb.MISSING_ENTRY_POINT:
        defined = error.get("defined") or []
        where = f"; it defines: {', '.join(defined)}" if defined else ""
        return (
            f"{headline}\n{sb.SOLUTION_NAME} does not define a function named "
            f"'{problem.entry_point}'{where}"
        )
    if o.status == sb.TIMEOUT:
        return (
            f"{headline}\nThe solution's top-level code did not finish within "
            f"{limits.timeout_s:g} s"
        )
    lines = [_VERDICTS["runtime_error" if o.status == sb.ERROR else o.status][0]]
    if error:
        lines.append(_exception_line(error))
        if error.get("line"):
            lines.append(
                f"Line {error['line']} in {error.get('function') or '<module>'} "
                f"({sb.SOLUTION_NAME})"
            )
    lines.append(f"({o.detail})")
    return "\n".join(lines)
