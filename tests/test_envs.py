"""Environments: judge feedback texts (on synthetic sandbox results), code extraction, QA
reveal, conversation loaders, make_env, and the bundled code problems with their references."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfdistill.data import Row
from selfdistill.envs import (
    CodeEnv,
    CodeProblem,
    ConversationEnv,
    Feedback,
    QAEnv,
    Sandbox,
    extract_code,
    load_code_problems,
    load_followups,
    make_env,
    step_many,
)
from selfdistill.envs import sandbox as sb
from selfdistill.envs.code import judge, same_value
from selfdistill.errors import DataError, UserError

REPO = Path(__file__).resolve().parents[1]
PROBLEM = CodeProblem.from_dict(
    {
        "prompt": "Write f(xs).",
        "entry_point": "f",
        "tests": [
            {"input": [[26, 30, 2]], "expected": 4},
            {"input": [[1]], "expected": [1, 2]},
            {"input": [[0]], "expected": 0.5},
        ],
    }
)
STDIO = CodeProblem.from_dict({"prompt": "Echo.", "tests": [{"stdin": "a\n", "stdout": "a\n"}]})


def run_result(*outcomes: sb.TestOutcome, limits: sb.Limits | None = None) -> sb.RunResult:
    return sb.RunResult(list(outcomes), "bwrap", limits or sb.Limits())


def ok(value, **kw) -> sb.TestOutcome:
    return sb.TestOutcome(sb.OK, value=value, **kw)


# --- judging and feedback text -------------------------------------------------------------


def test_all_passed():
    fb = judge(PROBLEM, "code", run_result(ok(4), ok([1, 2]), ok(0.5000000001)))
    assert (fb.passed, fb.reward, fb.kind, fb.text) == (
        True,
        1.0,
        "tests_passed",
        "Accepted\n\nPassed 3/3 tests.",
    )
    assert fb.evidence["test_statuses"] == ["passed"] * 3


def test_runtime_error_in_livecodebench_style():
    error = {
        "type": "ZeroDivisionError",
        "message": "division by zero",
        "line": 3,
        "function": "f",
        "text": "return 1 / 0",
    }
    fb = judge(
        PROBLEM, "code", run_result(sb.TestOutcome(sb.ERROR, error=error), ok([1, 2]), ok(0.5))
    )
    assert fb.kind == "runtime_error" and fb.reward == pytest.approx(2 / 3)
    assert fb.text == (
        "Runtime Error\nZeroDivisionError: division by zero\n"
        "Line 3 in f (solution.py)\nLast Executed Input\n[[26,30,2]]\n\n"
        "Passed 2/3 tests."
    )


def test_wrong_answers_show_at_most_two_cases():
    fb = judge(PROBLEM, "code", run_result(ok(5, stdout="dbg\n"), ok([1, 2]), ok(True)))
    assert (fb.kind, fb.evidence["status"]) == ("test_failure", "wrong_answer")
    assert fb.text.startswith(
        "Wrong Answer\nInput\n[[26,30,2]]\nExpected\n4\nGot\n5\n"
        "Stdout\ndbg\n\nWrong Answer\nInput\n[[0]]\nExpected\n0.5\n"
        "Got\ntrue\n"
    )
    assert fb.text.endswith("Passed 1/3 tests.")
    assert fb.evidence["failing_tests"] == [0, 2]


def test_non_json_return_value_shown_by_repr():
    fb = judge(
        PROBLEM,
        "code",
        run_result(
            sb.TestOutcome(sb.OK, value=None, value_json=False, value_repr="<object at 0x1>"),
            ok([1, 2]),
            ok(0.5),
        ),
    )
    assert "Got\n<object at 0x1>" in fb.text


@pytest.mark.parametrize(
    ("outcome", "kind", "expected"),
    [
        (
            sb.TestOutcome(sb.TIMEOUT, detail="did not finish within 2 s (wall clock)"),
            "timeout",
            "Time Limit Exceeded\nTest 1 did not finish within 2 s (wall clock)\n"
            "Last Executed Input\n[[26,30,2]]",
        ),
        (
            sb.TestOutcome(
                sb.MEMORY_LIMIT,
                error={"type": "MemoryError", "message": "", "line": 2, "function": "f"},
            ),
            "memory_limit",
            "Memory Limit Exceeded\nMemoryError (limit: 512 MiB of address space per process)\n"
            "Line 2 in f (solution.py)\nLast Executed Input\n[[26,30,2]]",
        ),
        (
            sb.TestOutcome(sb.OUTPUT_LIMIT, detail="the program printed more than 10 bytes"),
            "output_limit",
            "Output Limit Exceeded\nThe program printed more than 10 bytes\n"
            "Last Executed Input\n[[26,30,2]]",
        ),
        (
            sb.TestOutcome(
                sb.EXITED,
                detail="the process running the solution died: SIGSEGV",
                stderr="Fatal Python error",
            ),
            "runtime_error",
            "Runtime Error\nThe process running the solution died: SIGSEGV\nStderr (end)\n"
            "Fatal Python error\nLast Executed Input\n[[26,30,2]]",
        ),
    ],
)
def test_limit_and_crash_texts(outcome, kind, expected):
    fb = judge(PROBLEM, "code", run_result(outcome, ok([1, 2]), ok(0.5)))
    assert fb.kind == kind
    assert fb.text == expected + "\n\nPassed 2/3 tests."


def test_whole_program_failures_are_reported_once():
    syntax = sb.TestOutcome(
        sb.SYNTAX_ERROR,
        error={
            "type": "SyntaxError",
            "message": "expected ':'",
            "line": 2,
            "offset": 8,
            "text": "def f(x)",
        },
    )
    fb = judge(PROBLEM, "code", run_result(syntax, syntax, syntax))
    assert fb.kind == "syntax_error"
    assert fb.text == (
        "Syntax Error\nSyntaxError: expected ':'\nLine 2 (solution.py)\n"
        "    def f(x)\n           ^\n\nPassed 0/3 tests."
    )
    missing = sb.TestOutcome(sb.MISSING_ENTRY_POINT, error={"defined": ["g"]})
    fb = judge(PROBLEM, "code", run_result(missing, missing, missing))
    assert fb.text.startswith(
        "Missing Function\nsolution.py does not define a function named 'f'; it defines: g"
    )
    top = sb.TestOutcome(
        sb.ERROR,
        detail=sb.TOP_LEVEL,
        error={
            "type": "NameError",
            "message": "name 'np' is not defined",
            "line": 1,
            "function": "<module>",
        },
    )
    fb = judge(PROBLEM, "code", run_result(top, top, top))
    assert fb.text == (
        "Runtime Error\nNameError: name 'np' is not defined\n"
        "Line 1 in <module> (solution.py)\n"
        "(while running the solution's top-level code)\n\nPassed 0/3 tests."
    )


def test_not_run_tests_count_but_are_not_shown():
    crash = sb.TestOutcome(sb.EXITED, detail="the test harness was killed")
    fb = judge(PROBLEM, "code", run_result(ok(4), crash, sb.TestOutcome(sb.NOT_RUN)))
    assert fb.evidence["test_statuses"] == ["passed", "runtime_error", "not_run"]
    assert "Not Run" not in fb.text and fb.reward == pytest.approx(1 / 3)


def test_feedback_length_is_capped():
    huge = sb.TestOutcome(sb.ERROR, error={"type": "ValueError", "message": "x" * 5000})
    fb = judge(PROBLEM, "code", run_result(huge, huge, huge), max_chars=300)
    assert len(fb.text) == 300 and fb.text.endswith("(truncated)")
    uncapped = judge(PROBLEM, "code", run_result(huge, huge, huge), max_chars=0)
    assert len(uncapped.text) > 300


def test_stdio_comparison_ignores_trailing_whitespace_only():
    assert judge(STDIO, "c", run_result(ok(None, stdout="a  \n\n"))).passed
    fb = judge(STDIO, "c", run_result(ok(None, stdout=" a\n")))
    assert fb.text.startswith("Wrong Answer\nInput\na\nExpected\na\nGot\n a\n")


def test_same_value():
    assert same_value(0.1 + 0.2, 0.3) and same_value(212.0, 212)
    assert not same_value(1, True) and not same_value(0, False)
    assert same_value({"a": [1, 2.0]}, {"a": [1, 2]}) and not same_value([1], [1, 2])
    assert not same_value("1", 1) and not same_value(None, 0)


def test_no_code_is_judged_without_running():
    class NoSandbox:
        def run(self, job):
            raise AssertionError("must not run")

    env = CodeEnv(PROBLEM, sandbox=NoSandbox())  # type: ignore[arg-type]
    fb = env.step("```python\n\n```")
    assert (fb.kind, fb.reward, fb.passed) == ("no_code", 0.0, False)
    assert "contains no Python code" in fb.text


# --- code extraction -----------------------------------------------------------------------


def test_extract_code_prefers_the_block_defining_the_entry_point():
    answer = (
        "Here is f:\n```python\ndef f(x):\n    return x\n```\nUsage:\n```python\nprint(f(3))\n```\n"
    )
    assert extract_code(answer, "f") == "def f(x):\n    return x\n"
    assert extract_code(answer) == "print(f(3))\n"  # no entry point: the last python block


def test_extract_code_other_shapes():
    assert extract_code("```\ndef f(): pass\n```") == "def f(): pass\n"
    assert extract_code("```python\ndef f(x):\n    return x") == "def f(x):\n    return x"
    assert extract_code("def f(x): return x") == "def f(x): return x"
    assert extract_code("```py\na=1\n```\n```text\nout\n```") == "a=1\n"
    cls = "```python\nclass Solution:\n    def go(self): return 1\n```"
    assert extract_code("```python\nx = 1\n```\n" + cls, "Solution.go").startswith("class")


# --- problems ------------------------------------------------------------------------------


def test_bundled_problems_load_and_references_pass():
    problems = load_code_problems(REPO / "examples" / "code_problems.jsonl")
    assert len(problems) >= 10
    assert all(p.reference and p.entry_point and 3 <= len(p.tests) <= 6 for p in problems)
    sandbox = Sandbox(sb.Limits(timeout_s=2.0))
    results = sandbox.run_many([p.job(p.reference) for p in problems])
    for problem, result in zip(problems, results, strict=True):
        fb = judge(problem, problem.reference, result)
        assert fb.passed, f"{problem.entry_point}: {fb.text}"
    # and a wrong solution fails them (the tests discriminate)
    wrong = judge(
        problems[0],
        "def sum_evens(nums):\n    return sum(nums)\n",
        sandbox.run(problems[0].job("def sum_evens(nums):\n    return sum(nums)\n")),
    )
    assert not wrong.passed


def test_problem_file_errors_name_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    good = {"prompt": "p", "entry_point": "f", "tests": [{"input": [1], "expected": 1}]}
    bad_rows = [
        ({**good, "tests": []}, "'tests' must be a non-empty list"),
        ({**good, "tests": [{"input": 1, "expected": 1}]}, "'input': \\[args"),
        ({**good, "entry_point": "not valid"}, "'entry_point' must be a function name"),
        ({"prompt": "p", "tests": [{"stdin": "1"}]}, "stdin/stdout program"),
        ({"entry_point": "f", "tests": good["tests"]}, "missing 'prompt'"),
    ]
    for row, message in bad_rows:
        path.write_text(json.dumps(good) + "\n" + json.dumps(row) + "\n")
        with pytest.raises(DataError, match=f"bad.jsonl:2: .*{message}"):
            load_code_problems(path)


# --- QA ------------------------------------------------------------------------------------


def test_qa_reveal_on_and_off():
    env = QAEnv("Capital of France?", "Paris")
    right, wrong = env.step("It is paris."), env.step("Lyon")
    assert (right.reward, right.passed, right.kind) == (1.0, True, "ground_truth")
    assert (wrong.reward, wrong.passed) == (0.0, False)
    assert wrong.text == "Incorrect. The expected answer is: Paris"
    hidden = QAEnv("Capital of France?", ["Paris", "Paname"], reveal=False)
    fb = hidden.step("Lyon")
    assert (fb.text, fb.kind) == ("Incorrect.", "verdict")
    assert "Paris" not in fb.text
    assert QAEnv("q", ["Paris", "Paname"]).step("x").text == (
        "Incorrect. Accepted answers: Paris; Paname"
    )
    with pytest.raises(ValueError):
        QAEnv("q", [])


# --- conversations -------------------------------------------------------------------------


def _write(path: Path, rows: list) -> Path:
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_followup_triplets_and_chat_logs(tmp_path):
    u, a = "user", "assistant"
    path = _write(
        tmp_path / "c.jsonl",
        [
            {
                "messages": [{"role": u, "content": "Is water wet?"}],
                "response": "YES, water is wet.",
                "followup": "I said YES or NO only.",
            },
            {
                "messages": [
                    {"role": "system", "content": "Be brief."},
                    {"role": u, "content": "q1"},
                    {"role": a, "content": "r1"},
                    {"role": u, "content": "f1"},
                    {"role": a, "content": "r2"},
                    {"role": u, "content": "f2"},
                    {"role": a, "content": "r3"},
                ]
            },
        ],
    )
    examples = load_followups(path)
    assert [(e.response, e.followup) for e in examples] == [
        ("YES, water is wet.", "I said YES or NO only."),
        ("r1", "f1"),
        ("r2", "f2"),
    ]
    assert [m["content"] for m in examples[2].messages] == ["Be brief.", "q1", "r1", "f1"]
    assert examples[1].source == f"{path}:2#2"
    env = ConversationEnv(examples[0])
    fb = env.step("YES, water is wet.")
    assert (fb.kind, fb.text, fb.reward, fb.passed) == (
        "user_followup",
        "I said YES or NO only.",
        0.0,
        False,
    )
    assert fb.evidence["same_as_logged"] and not env.step("NO").evidence["same_as_logged"]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("{broken", "malformed JSON"),
        ({"messages": [{"role": "user", "content": "q"}], "response": "r"}, "'followup'"),
        (
            {"messages": [{"role": "user", "content": "q"}], "response": "", "followup": "f"},
            "'response' must be a non-empty string",
        ),
        (
            {"messages": [{"role": "bot", "content": "q"}], "response": "r", "followup": "f"},
            "'messages'\\[0\\] must be",
        ),
        (
            {"messages": [{"role": "assistant", "content": "q"}], "response": "r", "followup": "f"},
            "must end with a user turn",
        ),
        ({"messages": "hello"}, "non-empty list"),
        ({"prompt": "q"}, "expected 'messages'"),
    ],
)
def test_followup_loader_errors(tmp_path, row, message):
    good = {"messages": [{"role": "user", "content": "q"}], "response": "r", "followup": "f"}
    path = _write(tmp_path / "c.jsonl", [good, row])
    with pytest.raises(DataError, match=f"c.jsonl:2: .*{message}"):
        load_followups(path)


def test_followup_loader_needs_at_least_one_pair(tmp_path):
    path = _write(
        tmp_path / "c.jsonl",
        [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
    )
    with pytest.raises(DataError, match="no follow-ups"):
        load_followups(path)


# --- make_env and step_many ----------------------------------------------------------------


def test_make_env_chooses_by_columns():
    code = make_env({"prompt": "p", "entry_point": "f", "tests": [{"input": [1], "expected": 1}]})
    assert isinstance(code, CodeEnv) and code.messages == [{"role": "user", "content": "p"}]
    qa = make_env(Row([{"role": "user", "content": "q"}], ["42"], source="f.jsonl:3"), reveal=False)
    assert isinstance(qa, QAEnv) and qa.step("42").text == "Correct."
    conv = make_env(
        {
            "messages": [{"role": "user", "content": "q"}],
            "response": "r",
            "followup": "shorter please",
        }
    )
    assert isinstance(conv, ConversationEnv) and conv.step("r").text == "shorter please"
    with pytest.raises(UserError, match="no environment fits this row"):
        make_env({"prompt": "p"})
    with pytest.raises(UserError, match=r"f\.jsonl:7: 'tests' must be a non-empty list"):
        make_env(Row([{"role": "user", "content": "p"}], extra={"tests": []}, source="f.jsonl:7"))


def test_step_many_and_feedback_dict():
    envs = [QAEnv("q", "a"), QAEnv("q", "b")]
    feedback = step_many(envs, ["a", "a"], workers=2)
    assert [f.reward for f in feedback] == [1.0, 0.0]
    assert isinstance(feedback[0], Feedback)
    assert json.loads(json.dumps(feedback[1].to_dict()))["kind"] == "ground_truth"
    with pytest.raises(ValueError):
        step_many(envs, ["a"])
