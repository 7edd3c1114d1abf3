"""The code sandbox against correct, buggy and hostile programs.

Every test runs real programs in the real sandbox (bubblewrap here) and checks the verdict, the
feedback text, and that nothing is left behind: no temporary directory (autouse fixture) and no
process (unique markers in argv, searched in the host's /proc).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from selfdistill.envs import CodeEnv, CodeProblem, Job, Limits, Sandbox
from selfdistill.envs import sandbox as sb
from selfdistill.envs.cli import add_subcommand
from selfdistill.errors import UserError

LIMITS = Limits(timeout_s=1.0)
SANDBOX = Sandbox(LIMITS)
REPO = Path(__file__).resolve().parents[1]

ADD = CodeProblem.from_dict(
    {
        "prompt": "Write add(a, b).",
        "entry_point": "add",
        "tests": [
            {"input": [1, 2], "expected": 3},
            {"input": [5, 5], "expected": 10},
            {"input": [-1, 1], "expected": 0},
        ],
    }
)
ONE = CodeProblem.from_dict(
    {"prompt": "Write f(x).", "entry_point": "f", "tests": [{"input": [1], "expected": 1}]}
)
SUM_STDIO = CodeProblem.from_dict(
    {
        "prompt": "Print a + b.",
        "tests": [{"stdin": "2 3\n", "stdout": "5\n"}, {"stdin": "10 -4\n", "stdout": "6"}],
    }
)


@pytest.fixture(autouse=True)
def private_tmp(tmp_path, monkeypatch):
    """Every temporary directory the sandbox makes goes here; none may survive a run."""
    root = tmp_path / "tmp"
    root.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(root))
    yield root
    assert list(root.iterdir()) == [], "the sandbox left files behind"


def judge(problem: CodeProblem, code: str, sandbox: Sandbox = SANDBOX):
    return CodeEnv(problem, sandbox=sandbox).check(code)


def marker() -> str:
    return f"sdmark-{uuid.uuid4().hex}"


def processes_with(mark: str) -> list[int]:
    """Host pids whose command line contains `mark` (sandboxed processes are visible here)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if mark.encode() in cmdline:
            found.append(int(pid))
    return found


def wait_gone(mark: str, seconds: float = 2.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := processes_with(mark)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_isolation_here_is_bubblewrap():
    # The machine this suite targets has bubblewrap (scripts/install-system-deps.sh).
    assert sb.bwrap_problem() is None
    assert SANDBOX.isolation == "bwrap"


def test_correct_solution_passes():
    fb = judge(ADD, "def add(a, b):\n    return a + b\n")
    assert (fb.passed, fb.reward, fb.kind) == (True, 1.0, "tests_passed")
    assert fb.text == "Accepted\n\nPassed 3/3 tests."
    assert fb.evidence["isolation"] == "bwrap"


def test_wrong_answer_shows_input_expected_got_and_stdout():
    code = "def add(a, b):\n    print('debug', a)\n    return 0 if a == 5 else a + b\n"
    fb = judge(ADD, code)
    assert (fb.passed, fb.kind, fb.evidence["status"]) == (False, "test_failure", "wrong_answer")
    assert fb.reward == pytest.approx(2 / 3)
    assert "Wrong Answer\nInput\n[5,5]\nExpected\n10\nGot\n0\nStdout\ndebug 5" in fb.text
    assert fb.text.endswith("Passed 2/3 tests.")


def test_runtime_error_names_exception_line_and_input():
    code = "def add(a, b):\n    zero = 0\n    return (a + b) / zero\n"
    fb = judge(ADD, code)
    assert (fb.kind, fb.reward) == ("runtime_error", 0.0)
    assert fb.text.startswith(
        "Runtime Error\nZeroDivisionError: division by zero\n"
        "Line 3 in add (solution.py)\nLast Executed Input\n[1,2]"
    )
    assert fb.text.count("Runtime Error") == 2  # at most two failing cases are shown


def test_syntax_error_names_line():
    fb = judge(ADD, "x = 1\ndef add(a, b)\n    return a + b\n")
    assert fb.kind == "syntax_error"
    assert fb.text.startswith(
        "Syntax Error\nSyntaxError: expected ':'\nLine 2 (solution.py)\n    def add(a, b)"
    )
    assert fb.evidence["test_statuses"] == ["syntax_error"] * 3


def test_missing_entry_point_named():
    fb = judge(ADD, "def plus(a, b):\n    return a + b\n")
    assert fb.kind == "missing_entry_point"
    assert "does not define a function named 'add'; it defines: plus" in fb.text


def test_infinite_loop_times_out():
    started = time.monotonic()
    fb = judge(ONE, "def f(x):\n    while True:\n        pass\n")
    assert fb.kind == "timeout"
    assert fb.text.startswith("Time Limit Exceeded\nTest 1 did not finish within 1 s")
    assert "Last Executed Input\n[1]" in fb.text
    assert time.monotonic() - started < 1.0 + sb.STARTUP_S + 3


def test_wall_limit_from_outside_stops_the_attempt():
    mark = marker()
    code = f"""
import os, sys
def f(x):
    os.execv(sys.executable, [sys.executable, "-c", "while True: pass", "{mark}"])
"""
    started = time.monotonic()
    result = Sandbox(Limits(timeout_s=30, wall_s=1.5)).run(Job(code, [[1], [2]], "f"))
    assert time.monotonic() - started < 5
    assert [o.status for o in result.outcomes] == [sb.TIMEOUT, sb.NOT_RUN]
    assert "exceeded its wall-clock limit of 1.5 s" in result.outcomes[0].detail
    assert wait_gone(mark) == []


def test_limits_are_applied_to_the_program():
    code = """
import resource
def f(x):
    names = ["RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_NPROC", "RLIMIT_FSIZE", "RLIMIT_CORE"]
    return [resource.getrlimit(getattr(resource, n))[0] for n in names]
"""
    outcome = SANDBOX.run(Job(code, [[1]], "f")).outcomes[0]
    memory, cpu, nproc, fsize, core = outcome.value
    assert memory == LIMITS.memory_mb << 20 and fsize == LIMITS.scratch_mb << 20
    assert 0 < cpu <= 10 and core == 0
    # + the supervisor, which shares the uid (and, in a user namespace, bubblewrap's init)
    assert nproc == LIMITS.max_processes + (1 if os.geteuid() == 0 else 2)


def test_top_level_hang_times_out_once():
    fb = judge(ADD, "import time\ntime.sleep(60)\ndef add(a, b):\n    return a + b\n")
    assert fb.kind == "timeout"
    assert "top-level code did not finish within 1 s" in fb.text
    assert fb.text.count("Time Limit Exceeded") == 1


def test_memory_hog_hits_memory_limit():
    # Filling 512 MiB takes ~0.5 s here, more on a loaded machine: a generous time limit.
    sandbox = Sandbox(Limits(timeout_s=10.0))
    code = "def f(x):\n    hog = []\n    while True:\n        hog.append(bytearray(1 << 20))\n"
    fb = judge(ONE, code, sandbox)
    assert fb.kind == "memory_limit"
    assert fb.text.startswith("Memory Limit Exceeded\nMemoryError (limit: 512 MiB")
    assert "Line 4 in f (solution.py)" in fb.text
    at_once = judge(ONE, "def f(x):\n    return len(bytearray(8 << 30))\n", sandbox)
    assert at_once.kind == "memory_limit"


def test_fork_count_is_capped_and_children_die():
    mark = marker()
    code = f"""
import os, sys
def f(x):
    n = 0
    for _ in range(200):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)",
                                      "{mark}"])
        n += 1
    return n
"""
    result = SANDBOX.run(Job(code, [[1]], "f"))
    forks = result.outcomes[0].value
    assert result.outcomes[0].status == sb.OK
    assert forks == LIMITS.max_processes - 1  # the program's first process counts too
    assert wait_gone(mark) == []


def test_fork_bomb_is_contained():
    mark = marker()
    bomb = "import os\\nwhile True:\\n  try:\\n    os.fork()\\n  except OSError:\\n    pass"
    code = f"""
import os, sys
def f(x):
    os.execv(sys.executable, [sys.executable, "-c", "{bomb}", "{mark}"])
"""
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:  # how many bomb processes exist at once, seen from the host
        while not done.is_set():
            seen.append(len(processes_with(mark)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        fb = judge(ONE, code)
    finally:
        done.set()
        watcher.join()
    assert fb.kind == "timeout"
    assert 0 < max(seen) <= LIMITS.max_processes
    assert wait_gone(mark) == []


def test_no_network():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    try:
        # Sanity: from the host both ports accept connections, so a failure below is isolation.
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        code = f"""
import socket
import subprocess
import sys
def f(x):
    out = []
    for port in ({port}, 5432):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
            out.append("connected")
        except OSError as exc:
            out.append(type(exc).__name__)
    try:
        socket.getaddrinfo("pypi.org", 443)
        out.append("resolved")
    except OSError as exc:
        out.append(type(exc).__name__)
    return out
"""
        outcome = SANDBOX.run(Job(code, [[1]], "f")).outcomes[0]
    finally:
        listener.close()
    assert outcome.status == sb.OK
    assert "connected" not in outcome.value and "resolved" not in outcome.value


def test_postgres_port_unreachable_is_a_runtime_error():
    code = (
        "import socket\ndef f(x):\n"
        "    socket.create_connection(('127.0.0.1', 5432), timeout=2)\n    return x\n"
    )
    fb = judge(ONE, code)
    assert fb.kind == "runtime_error"
    assert "Line 3 in f (solution.py)" in fb.text
    assert "Error" in fb.text.splitlines()[1]  # ConnectionRefusedError / OSError: ...


def test_cannot_write_outside_its_scratch_dir():
    mark = marker()
    targets = [
        str(REPO / f"{mark}.txt"),
        f"/tmp/{mark}",
        f"/root/{mark}",
        f"/sandbox/{mark}",
        f"/{mark}",
    ]
    code = f"""
def f(x):
    out = {{}}
    for path in {targets!r} + ["local-{mark}"]:
        try:
            with open(path, "w") as fh:
                fh.write("pwned")
            out[path] = "written"
        except OSError as exc:
            out[path] = type(exc).__name__
    return out
"""
    outcome = SANDBOX.run(Job(code, [[1]], "f")).outcomes[0]
    assert outcome.status == sb.OK
    written = {p for p, r in outcome.value.items() if r == "written"}
    # Its private /tmp (also its working directory) is writable; nothing else is.
    assert written == {f"/tmp/{mark}", f"local-{mark}"}
    for path in targets:
        assert not os.path.exists(path)


def test_cannot_read_project_home_or_etc():
    secrets = [
        REPO / "pyproject.toml",
        Path("/etc/hostname"),
        Path("/etc/passwd"),
        Path("/root/.bashrc"),
    ]
    assert all(p.is_file() for p in secrets)  # they exist on the host
    code = f"""
import os
def f(x):
    out = []
    for path in {[str(p) for p in secrets]!r}:
        try:
            with open(path) as fh:
                fh.read()
            out.append(path)
        except OSError:
            pass
    for d in ("/home", "/work", "/root"):
        try:
            out += [d + "/" + n for n in os.listdir(d) if n != ".pyenv"]
        except OSError:
            pass
    return out
"""
    outcome = SANDBOX.run(Job(code, [[1]], "f")).outcomes[0]
    assert outcome.status == sb.OK
    assert outcome.value == []


def test_daemonized_child_is_killed():
    mark = marker()
    code = f"""
import subprocess, sys
def f(x):
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "{mark}"],
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    return proc.pid > 0
"""
    fb = judge(ONE, code.replace("return proc.pid > 0", "return 1 if proc.pid > 0 else 0"))
    assert fb.passed
    assert wait_gone(mark) == []


def test_output_flood_is_cut_short():
    started = time.monotonic()
    fb = judge(ONE, "def f(x):\n    while True:\n        print('spam' * 1000)\n")
    assert fb.kind == "output_limit"
    assert f"printed more than {LIMITS.output_bytes}" in fb.text
    raw = judge(ONE, "import os\ndef f(x):\n    while True:\n        os.write(1, b'x' * 65536)\n")
    assert raw.kind == "output_limit"
    assert time.monotonic() - started < 8


def test_fake_passed_output_is_not_believed():
    code = """
import json, os
def add(a, b):
    print("Accepted")
    print("Passed 3/3 tests.")
    for k, value in enumerate([3, 10, 0]):
        fake = json.dumps({"test": k, "status": "ok", "value": value, "event": "result"})
        print(fake)
        for fd in range(3, 64):  # try to forge reports on any inherited pipe
            try:
                os.write(fd, (fake + "\\n").encode())
            except OSError:
                pass
    return -1
"""
    fb = judge(ADD, code)
    assert (fb.passed, fb.reward, fb.evidence["status"]) == (False, 0.0, "wrong_answer")
    result = SANDBOX.run(ADD.job(code))
    assert result.forged_lines == 0  # nothing even reached the report pipe


def test_os_exit_before_returning():
    fb = judge(ONE, "import os\ndef f(x):\n    os._exit(0)\n")
    assert fb.kind == "runtime_error"
    assert "ended with exit status 0 before the test returned" in fb.text


def test_killing_the_harness():
    fb = judge(
        ADD,
        "import os, signal\ndef add(a, b):\n    os.kill(os.getppid(), "
        "signal.SIGKILL)\n    return a + b\n",
    )
    assert (fb.kind, fb.passed) == ("runtime_error", False)
    assert "harness was killed while running this test" in fb.text
    assert fb.evidence["test_statuses"] == ["runtime_error", "not_run", "not_run"]


def test_closing_all_fds():
    fb = judge(ONE, "import os\ndef f(x):\n    os.closerange(0, 4096)\n    return x\n")
    assert (fb.kind, fb.passed) == ("runtime_error", False)
    assert "ended with exit status" in fb.text


def test_stdio_program_pass_wrong_and_error():
    good = judge(SUM_STDIO, "a, b = map(int, input().split())\nprint(a + b)\n")
    assert good.passed and good.reward == 1.0
    wrong = judge(SUM_STDIO, "a, b = map(int, input().split())\nprint(a + b + 1)\n")
    assert wrong.kind == "test_failure"
    assert "Wrong Answer\nInput\n2 3\nExpected\n5\nGot\n6\n" in wrong.text
    boom = judge(SUM_STDIO, "a, b = map(int, input().split())\nprint(a // (b - 3))\n")
    assert boom.kind == "runtime_error"
    assert "ZeroDivisionError: integer division or modulo by zero\nLine 2 in <module>" in boom.text


def test_return_values_cross_as_json():
    code = (
        "import math\ndef f(x):\n    return [(1, 2), {3, 1}, {'k': None}, math.inf, 2 ** 70]\n"
        "def g(x):\n    return object()\n"
    )
    outcome = SANDBOX.run(Job(code, [[0]], "f")).outcomes[0]
    assert outcome.value == [[1, 2], [1, 3], {"k": None}, float("inf"), 2**70]
    odd = SANDBOX.run(Job(code, [[0]], "g")).outcomes[0]
    assert (odd.status, odd.value_json) == (sb.OK, False)
    assert odd.value_repr.startswith("<object object at")


def test_run_many_keeps_order():
    jobs = [Job(f"def f(x):\n    return x * {k}\n", [[2], [3]], "f") for k in range(4)]
    results = SANDBOX.run_many(jobs, workers=2)
    assert [[o.value for o in r.outcomes] for r in results] == [[2 * k, 3 * k] for k in range(4)]


def test_refuses_to_run_unisolated_without_opt_in(monkeypatch):
    monkeypatch.delenv(sb.ALLOW_ENV, raising=False)
    monkeypatch.setattr(sb, "bwrap_problem", lambda: "bubblewrap (bwrap) is not installed")
    with pytest.raises(sb.SandboxUnavailable, match="install bubblewrap"):
        _ = Sandbox().isolation
    with pytest.raises(sb.SandboxUnavailable, match="allow_unisolated"):
        _ = Sandbox(isolation="none").isolation
    monkeypatch.setenv(sb.ALLOW_ENV, "1")
    with pytest.warns(UserWarning, match="WITHOUT isolation"):
        assert Sandbox().isolation == "none"


def test_unisolated_mode_still_judges_and_cleans_up():
    sandbox = Sandbox(LIMITS, isolation="none", allow_unisolated=True)
    assert judge(ADD, "def add(a, b):\n    return a + b\n", sandbox).passed
    fb = judge(ONE, "def f(x):\n    while True:\n        pass\n", sandbox)
    assert fb.kind == "timeout"


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="selfdistill")
    add_subcommand(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_check(tmp_path, capsys):
    problem = tmp_path / "p.json"
    problem.write_text(
        json.dumps({"entry_point": "add", "tests": [{"input": [1, 2], "expected": 3}]})
    )
    good, bad = tmp_path / "good.py", tmp_path / "bad.py"
    good.write_text("```python\ndef add(a, b):\n    return a + b\n```\n")
    bad.write_text("def add(a, b):\n    return a / 0\n")
    assert _cli(["sandbox", "check", "--problem", str(problem), "--solution", str(good)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out == {
        "passed": True,
        "reward": 1.0,
        "status": "passed",
        "feedback": "Accepted\n\nPassed 1/1 tests.",
    }
    assert (
        _cli(
            [
                "sandbox",
                "check",
                "--problem",
                str(problem),
                "--solution",
                str(bad),
                "--timeout",
                "1",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert (out["passed"], out["status"]) == (False, "runtime_error")
    assert "ZeroDivisionError" in out["feedback"]


def test_cli_check_rejects_malformed_problem(tmp_path):
    solution = tmp_path / "s.py"
    solution.write_text("def add(a, b):\n    return a + b\n")
    for content, message in [
        ("{not json", "malformed JSON"),
        (json.dumps({"entry_point": "add", "tests": []}), "'tests'"),
        (json.dumps({"entry_point": "add", "tests": [{"input": [1]}]}), "'expected'"),
    ]:
        problem = tmp_path / "p.json"
        problem.write_text(content)
        with pytest.raises(UserError, match=message):
            _cli(["sandbox", "check", "--problem", str(problem), "--solution", str(solution)])


def test_main_cli_exit_codes(tmp_path):
    """Through `python -m selfdistill`: 0 whatever the program did, 2 for a malformed problem."""
    problem, solution = tmp_path / "p.json", tmp_path / "s.py"
    problem.write_text(
        json.dumps({"entry_point": "add", "tests": [{"input": [1, 2], "expected": 3}]})
    )
    solution.write_text("import os\ndef add(a, b):\n    os._exit(3)\n")
    argv = [
        sys.executable,
        "-m",
        "selfdistill",
        "sandbox",
        "check",
        "--problem",
        str(problem),
        "--solution",
        str(solution),
    ]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["status"] == "runtime_error"
    problem.write_text("{")
    done = subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=60)
    assert done.returncode == 2 and "malformed JSON" in done.stderr
