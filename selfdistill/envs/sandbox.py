"""Run untrusted (model-written) Python against test inputs, isolated, and report what it did.

Three processes, outermost first:

- the *runner* (`Sandbox.run`, this process) starts bubblewrap, hands the job to the supervisor,
  reads its reports and enforces the overall wall-clock limit from outside;
- the *supervisor* (`harness.py` run as a script, pid 2 of a fresh PID namespace) starts a worker,
  enforces the per-test timeout and the output cap, and reports each test to the runner over a
  pipe that only it holds, every line signed with a nonce the program never sees;
- the *worker* (`harness.py` again, the only process that runs model code) executes the solution:
  either imports it and calls the entry point once per test input, or runs it as a
  stdin/stdout program. After a crash, timeout or output flood the supervisor kills everything
  else in the namespace and starts a fresh worker for the next test.

Expected outputs never enter the sandbox: the worker reports what the program returned or printed,
and the caller (`selfdistill.envs.code`) compares. A program that forges a report can only claim
a return value, which is no more than returning it. What it prints is captured, never parsed.

Isolation ("bwrap", bubblewrap, Debian package `bubblewrap`; `scripts/install-system-deps.sh`):
new PID, network (loopback only), IPC and UTS namespaces; a new root holding only /usr (with the
/bin, /lib* links), /etc/ld.so.cache, the Python installation and the solution, all read-only,
plus a fresh /proc, a minimal /dev and a size-capped tmpfs at /tmp (the working directory). The
project, /home, /root, the rest of /etc and other users' files are not there. As root, the
program runs under a random unprivileged uid with no capabilities (`setpriv`), so RLIMIT_NPROC
applies (root is exempt from it) and counts only this sandbox's processes; as an ordinary user,
bubblewrap's user namespace gives the same per-sandbox count. Killing the namespace's init
(bubblewrap dies with its parent) kills every process, `setsid` or not.

Limits per process of the program: RLIMIT_AS (memory), RLIMIT_CPU (a backstop), RLIMIT_NPROC,
RLIMIT_FSIZE, no core files; per test: wall-clock timeout and output cap; per attempt: a
wall-clock limit enforced from outside.

No isolation ("none") runs the supervisor as a plain subprocess in a private temporary directory
with the memory, CPU and file-size limits: it protects nothing (files, network, processes that
`setsid` away; no process-count limit) and is refused unless the caller opts in with
`allow_unisolated=True` or `SELFDISTILL_ALLOW_UNISOLATED=1`.

The supervisor and worker live in `selfdistill.envs.harness`, the file copied into the sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import selectors
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from selfdistill.envs import harness
from selfdistill.envs.harness import (  # noqa: F401  (statuses are part of this module's API)
    ERROR,
    EXITED,
    MEMORY_LIMIT,
    MISSING_ENTRY_POINT,
    NOT_RUN,
    OK,
    OUTPUT_LIMIT,
    PYTHON_FLAGS,
    SOLUTION_NAME,
    STARTUP_S,
    SYNTAX_ERROR,
    TIMEOUT,
    TOP_LEVEL,
    WHOLE_PROGRAM,
    _Capped,
)
from selfdistill.errors import UserError

ALLOW_ENV = "SELFDISTILL_ALLOW_UNISOLATED"
ISOLATIONS = ("auto", "bwrap", "none")


class SandboxUnavailable(UserError):
    """No isolation is available and running unisolated was not allowed."""


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): bubblewrap or Python did not start."""


@dataclass(frozen=True)
class Limits:
    """Resource limits of one attempt. Memory and process limits are per sandbox."""

    timeout_s: float = 2.0  # wall-clock seconds per test; the first test also pays for imports
    memory_mb: int = 512  # address space of each process of the program (RLIMIT_AS), MiB
    max_processes: int = 16  # processes and threads the program may have at once, itself included
    output_bytes: int = 65_536  # stdout + stderr per test; more ends the test as output_limit
    scratch_mb: int = 64  # size of the writable /tmp, and the largest file (RLIMIT_FSIZE), MiB
    wall_s: float | None = None  # whole attempt; None: 5 s + (tests + 1) × (timeout_s + STARTUP_S)

    def wall_for(self, n_tests: int) -> float:
        """The wall-clock limit of an attempt with `n_tests` tests."""
        if self.wall_s is not None:
            return self.wall_s
        return 5.0 + (n_tests + 1) * (self.timeout_s + STARTUP_S)


@dataclass
class Job:
    """One attempt: a program and the inputs of its tests."""

    code: str
    inputs: list[Any]  # function mode: one argument list per test; stdio mode: one stdin string
    entry_point: str | None = None  # function (or "Class.method") to call; None: stdio program


@dataclass
class TestOutcome:
    """What one test did. `value` is only meaningful when status is "ok" in function mode."""

    __test__ = False  # not a pytest class

    status: str
    value: Any = None  # the return value as JSON data (tuples → lists, sets → sorted lists)
    value_repr: str = ""  # repr() of the return value, for values JSON cannot carry
    value_json: bool = True  # False: the value had no JSON form; compare value_repr instead
    stdout: str = ""  # function mode: what it printed; stdio mode: its answer (capped)
    stderr: str = ""
    error: dict[str, Any] | None = None  # type, message, line, function, text, offset
    detail: str = ""  # why the test ended, in words (timeouts, crashes, limits)
    seconds: float = 0.0


@dataclass
class RunResult:
    """All tests of one attempt, in input order, plus how it was run."""

    outcomes: list[TestOutcome]
    isolation: str
    limits: Limits
    seconds: float = 0.0
    log: str = ""  # the launcher's own stderr (capped), for diagnosing the sandbox
    forged_lines: int = 0  # report lines without the nonce (never trusted, only counted)
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# The runner (outside the sandbox)
# ---------------------------------------------------------------------------------------------


def unisolated_allowed(allow: bool | None = None) -> bool:
    """`allow` when given, else the environment variable SELFDISTILL_ALLOW_UNISOLATED."""
    if allow is not None:
        return allow
    return os.environ.get(ALLOW_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def bwrap_problem() -> str | None:
    """None when bubblewrap can run Python here, else the reason (cached per process)."""
    return _probe_bwrap()


@lru_cache(maxsize=1)
def _probe_bwrap() -> str | None:
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "setpriv (util-linux) is missing, needed to drop root inside the sandbox"
    with tempfile.TemporaryDirectory(prefix="selfdistill-probe-") as tmp:
        uid = _sandbox_uid()
        if uid is not None:
            os.chown(tmp, uid, uid)
        argv = [*_bwrap_argv(tmp, uid, Limits()), _python(), *PYTHON_FLAGS, "-c", "pass"]
        try:
            proc = subprocess.run(argv, capture_output=True, timeout=30, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"bwrap failed to start: {exc}"
    if proc.returncode != 0:
        stderr = proc.stderr.decode(errors="replace")[:300]
        return f"bwrap failed (exit {proc.returncode}): {stderr}"
    return None


def resolve_isolation(isolation: str = "auto", allow_unisolated: bool | None = None) -> str:
    """The isolation to use: "bwrap" or "none". Raises SandboxUnavailable with the fix."""
    if isolation not in ISOLATIONS:
        raise UserError(f"unknown isolation {isolation!r}: use one of {ISOLATIONS}")
    allowed = unisolated_allowed(allow_unisolated)
    if isolation == "none":
        if not allowed:
            raise SandboxUnavailable(
                "isolation='none' runs model-written code with your permissions: set "
                f"allow_unisolated=True or {ALLOW_ENV}=1 to confirm"
            )
        return "none"
    problem = bwrap_problem()
    if problem is None:
        return "bwrap"
    fix = (
        "install bubblewrap (`scripts/install-system-deps.sh`, or `apt-get install -y bubblewrap`)"
    )
    if isolation == "auto" and allowed:
        warnings.warn(
            f"running model-written code WITHOUT isolation: {problem}; {fix}", stacklevel=2
        )
        return "none"
    raise SandboxUnavailable(
        f"cannot isolate model-written code: {problem}. Fix: {fix}; or, knowing that the code "
        f"then runs with your permissions, set {ALLOW_ENV}=1 (or allow_unisolated=True)"
    )


class Sandbox:
    """Runs jobs under one set of limits. Isolation is resolved on first use (and cached)."""

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        isolation: str = "auto",
        allow_unisolated: bool | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self._requested, self._allow = isolation, allow_unisolated
        self._isolation: str | None = None

    @property
    def isolation(self) -> str:
        """ "bwrap" or "none"; raises SandboxUnavailable when neither may be used."""
        if self._isolation is None:
            self._isolation = resolve_isolation(self._requested, self._allow)
        return self._isolation

    def run(self, job: Job) -> RunResult:
        """Run every test of `job` in one sandbox and return one outcome per input."""
        isolation, limits = self.isolation, self.limits
        started = time.monotonic()
        nonce = secrets.token_hex(16)
        with tempfile.TemporaryDirectory(prefix="selfdistill-sbx-") as tmp:
            box = Path(tmp, "box")
            box.mkdir()
            uid = _sandbox_uid() if isolation == "bwrap" else None
            _write_box(box, job.code, uid)
            job_path = Path(tmp, "job.json")  # outside the box: the program cannot read it
            job_path.write_text(
                json.dumps(
                    {
                        "nonce": nonce,
                        "inputs": job.inputs,
                        "entry_point": job.entry_point,
                        "limits": asdict(limits),
                        "pidns": isolation == "bwrap",
                        "nproc_shared": _nproc_shared(isolation, uid),
                    }
                )
            )
            if isolation == "bwrap":
                root, cwd = "/sandbox", "/"
                launcher = _bwrap_argv(str(box), uid, limits)
            else:
                root, cwd, launcher = str(box), str(box), []
            reports, log, hit_wall = _launch(
                launcher,
                root,
                cwd,
                job_path,
                limits.wall_for(len(job.inputs)),
                cap=(len(job.inputs) + 2) * (3 * limits.output_bytes + 8192),
            )
        outcomes, forged, ready = _parse_reports(reports, nonce, len(job.inputs))
        if not ready:
            raise SandboxError(f"the sandbox did not start ({isolation}): {log.strip()[:500]}")
        _fill_missing(outcomes, hit_wall, limits.wall_for(len(job.inputs)))
        return RunResult(outcomes, isolation, limits, time.monotonic() - started, log, forged)

    def run_many(self, jobs: list[Job], workers: int | None = None) -> list[RunResult]:
        """Run jobs in parallel (a thread per running sandbox; default: one per CPU core)."""
        if not jobs:
            return []
        _ = self.isolation  # resolve (and possibly raise) once, before starting threads
        workers = max(1, min(workers or os.cpu_count() or 1, len(jobs)))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(self.run, jobs))


def _python() -> str:
    # The real interpreter, not a venv wrapper: the sandbox holds its installation, no site.
    return os.path.realpath(sys.executable)


def _sandbox_uid() -> int | None:
    """As root: a random unprivileged uid for this sandbox alone, so that RLIMIT_NPROC applies
    (root is exempt) and counts this sandbox's processes only. Otherwise None."""
    if os.geteuid() != 0:
        return None
    return 1_000_000 + secrets.randbelow(1_000_000)


def _nproc_shared(isolation: str, uid: int | None) -> int | None:
    """Processes outside the program that count against its RLIMIT_NPROC: the supervisor, and
    in a user namespace bubblewrap's init too. None (no limit) when unisolated, where the
    count would include all of the user's processes."""
    if isolation != "bwrap":
        return None
    return 1 if uid is not None else 2


def _write_box(box: Path, code: str, uid: int | None) -> None:
    (box / "harness.py").write_text(_harness_source(), encoding="utf-8")
    (box / SOLUTION_NAME).write_text(code, encoding="utf-8")
    if uid is not None:
        for path in (box, box / "harness.py", box / SOLUTION_NAME):
            os.chown(path, uid, uid)


@lru_cache(maxsize=1)
def _harness_source() -> str:
    return Path(harness.__file__).read_text(encoding="utf-8")


def _bwrap_argv(box: str, uid: int | None, limits: Limits) -> list[str]:
    # Namespaces: PID (init kills all at exit), network (loopback only), IPC, UTS, cgroup.
    argv = shlex.split(
        "bwrap --die-with-parent --new-session --hostname sandbox --ro-bind /usr /usr"
    )
    argv += shlex.split(
        "--unshare-pid --unshare-net --unshare-ipc --unshare-uts --unshare-cgroup-try"
    )
    if uid is None:  # not root: a user namespace, in which RLIMIT_NPROC counts per sandbox
        argv += ["--unshare-user"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = "/" + name
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    argv += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefix = os.path.realpath(sys.base_prefix)
    if not prefix.startswith("/usr/"):
        # Parents such as /root are 0700 on the host; recreate them traversable, empty.
        parts = Path(prefix).parts
        for i in range(2, len(parts)):
            argv += ["--perms", "0755", "--dir", str(Path(*parts[:i]))]
        argv += ["--ro-bind", prefix, prefix]
    argv += ["--ro-bind", box, "/sandbox", "--size", str(limits.scratch_mb << 20)]
    argv += shlex.split("--perms 1777 --tmpfs /tmp --proc /proc --dev /dev --chdir /tmp --clearenv")
    argv += shlex.split("--setenv PATH /usr/bin:/bin --setenv HOME /tmp --setenv LANG C.UTF-8")
    if uid is not None:  # root: become a fresh unprivileged uid without any capability
        argv += [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}"]
        argv += ["--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
    return argv


def _launch(
    launcher: list[str], root: str, cwd: str, job_path: Path, wall_s: float, cap: int
) -> tuple[bytes, str, bool]:
    """Start the supervisor; return (its report bytes, launcher stderr, hit the wall limit)."""
    read_fd, write_fd = os.pipe()
    argv = [*launcher, _python(), *PYTHON_FLAGS, f"{root}/harness.py", "supervise", str(write_fd)]
    try:
        with open(job_path, "rb") as stdin:
            proc = subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(write_fd,),
                cwd=cwd,
                start_new_session=True,
            )
    except OSError as exc:
        os.close(read_fd)
        raise SandboxError(f"cannot start the sandbox: {exc}") from exc
    finally:
        os.close(write_fd)
    assert proc.stderr is not None
    reports, errors = _Capped(read_fd, cap), _Capped(proc.stderr.fileno(), 16_384)
    deadline = time.monotonic() + wall_s
    try:
        hit_wall = not _pump([reports, errors], deadline)
    finally:
        _kill_group(proc.pid)  # bwrap dies, its namespace init with it, and so every process
        proc.wait()
        proc.stderr.close()
        os.close(read_fd)
    return bytes(reports.data), errors.text(), hit_wall


def _parse_reports(data: bytes, nonce: str, n: int) -> tuple[list[TestOutcome | None], int, bool]:
    outcomes: list[TestOutcome | None] = [None] * n
    forged, ready, known = 0, False, set(TestOutcome.__dataclass_fields__)
    for line in data.decode("utf-8", errors="replace").splitlines():
        tag, _, body = line.partition(" ")
        if tag != nonce:
            forged += 1
            continue
        msg = json.loads(body)
        if msg.get("event") == "ready":
            ready = True
        elif msg.get("event") == "result" and 0 <= msg.get("test", -1) < n:
            outcomes[msg["test"]] = TestOutcome(**{k: v for k, v in msg.items() if k in known})
    return outcomes, forged, ready


def _fill_missing(outcomes: list[TestOutcome | None], hit_wall: bool, wall_s: float) -> None:
    """Tests the supervisor never reported: the first one was running when it stopped."""
    first = True
    for i, outcome in enumerate(outcomes):
        if outcome is not None:
            continue
        if not first:
            outcomes[i] = TestOutcome(NOT_RUN, detail="an earlier test stopped the harness")
        elif hit_wall:
            outcomes[i] = TestOutcome(
                TIMEOUT,
                detail=f"the whole attempt exceeded its wall-clock "
                f"limit of {wall_s:g} s while running this test",
            )
        else:
            outcomes[i] = TestOutcome(
                EXITED,
                detail="the test harness was killed while running "
                "this test (did the program kill its parent process?)",
            )
        first = False


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _pump(readers: list[_Capped], deadline: float) -> bool:
    """Read all readers to EOF; False when the deadline came first."""
    sel = selectors.DefaultSelector()
    for r in readers:
        sel.register(r.fd, selectors.EVENT_READ, r)
    try:
        while any(not r.eof for r in readers):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            for key, _ in sel.select(left):
                reader = key.data
                reader.read()
                if reader.eof:
                    sel.unregister(reader.fd)
        return True
    finally:
        sel.close()

