"""The harness that runs INSIDE the sandbox: the supervisor and the worker (see
`selfdistill.envs.sandbox` for the three-process design and the isolation).

This file is copied into the sandbox and run alone (`python -I -S harness.py supervise FD`), so
it imports only the standard library. The runner (`sandbox.py`) imports its statuses and the
capped pipe reader from here, so both sides share one definition.
"""

from __future__ import annotations

import builtins
import contextlib
import io
import json
import math
import os
import secrets
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

SOLUTION_NAME = "solution.py"  # the file name tracebacks and feedback show
PYTHON_FLAGS = ("-I", "-S", "-B", "-X", "utf8")  # isolated: no site, no env vars, no .pyc
STARTUP_S = 2.0  # allowance for starting a worker (Python start-up), not charged to the program

# Test statuses (TestOutcome.status).
OK = "ok"  # returned / exited normally; whether the answer is right is the caller's business
ERROR = "error"  # raised an exception (error has type, message, line, function)
TIMEOUT = "timeout"
MEMORY_LIMIT = "memory_limit"
OUTPUT_LIMIT = "output_limit"
EXITED = "exited"  # the process ended (or the harness died) before the test returned
SYNTAX_ERROR = "syntax_error"
MISSING_ENTRY_POINT = "missing_entry_point"
NOT_RUN = "not_run"
WHOLE_PROGRAM = (SYNTAX_ERROR, MISSING_ENTRY_POINT, ERROR, MEMORY_LIMIT, OUTPUT_LIMIT)
TOP_LEVEL = "while running the solution's top-level code"  # detail of import-time failures


# ---------------------------------------------------------------------------------------------
# Reading pipes with a cap (runner and supervisor)
# ---------------------------------------------------------------------------------------------


class _Capped:
    """One pipe: keeps the first `cap` bytes, drains and discards the rest (bounded memory)."""

    def __init__(self, fd: int, cap: int) -> None:
        self.fd, self.cap = fd, cap
        self.data = bytearray()
        self.dropped = 0
        self.eof = False
        os.set_blocking(fd, False)

    def read(self) -> bytes:
        """Read what is available now; returns the bytes kept."""
        kept = bytearray()
        while not self.eof:
            try:
                chunk = os.read(self.fd, 65_536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                break
            room = max(0, self.cap - len(self.data))
            self.data += chunk[:room]
            kept += chunk[:room]
            self.dropped += len(chunk) - min(room, len(chunk))
        return bytes(kept)

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------
# The supervisor (inside the sandbox; trusted, never runs program code)
# ---------------------------------------------------------------------------------------------


def _send(fd: int, msg: dict[str, Any], prefix: str = "") -> None:
    data = (prefix + json.dumps(msg) + "\n").encode("utf-8")
    while data:
        data = data[os.write(fd, data) :]


def _supervise(report_fd: int) -> None:
    job = json.loads(sys.stdin.buffer.read())
    # Replace (not close) stdin: a closed fd 0 would be reused by the next file we open.
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    _make_undumpable()
    nonce = job.pop("nonce") + " "

    def emit(msg: dict[str, Any]) -> None:
        _send(report_fd, msg, nonce)

    emit({"event": "ready"})
    i, n = 0, len(job["inputs"])
    while i < n:
        i = _Worker(job, i, emit).run()
    emit({"event": "done"})


def _make_undumpable() -> None:
    # Non-dumpable: the program (same uid) cannot ptrace us or open /proc/<us>/fd/* to reach
    # the report pipe.
    import ctypes

    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4


class _Worker:
    """One worker process running tests first.. (stdio: test `first` only)."""

    def __init__(self, job: dict[str, Any], first: int, emit: Any) -> None:
        self.job, self.first, self.emit = job, first, emit
        self.limits = job["limits"]
        self.stdio = job["entry_point"] is None
        self.n = len(job["inputs"])
        self.last = first if self.stdio else self.n - 1  # the last test this worker runs
        self.current = first
        self.ready = False  # the worker has started; function mode: and run the top level
        self.pending: dict[str, Any] | None = None  # stdio: the report, final once it exits
        self.consumed = 0  # bytes of the result pipe already parsed
        # Stops blind forgery (writing fake reports to every fd). A program that digs the
        # nonce out of the worker's memory can claim a return value for the running test
        # only, which is no more than returning it: expected values never enter the sandbox.
        self.nonce = secrets.token_hex(8)

    def run(self) -> int:
        """Run until this worker is done or dead; returns the next test to run."""
        inputs = self.job["inputs"]
        mine = inputs[self.first : self.last + 1]
        job = json.dumps(
            {
                "entry_point": self.job["entry_point"],
                "inputs": mine,
                "first": self.first,
                "nonce": self.nonce,
                "output_bytes": self.limits["output_bytes"],
            }
        ).encode()
        res_r, res_w = os.pipe()
        try:
            with tempfile.TemporaryFile() as job_file, tempfile.TemporaryFile() as stdin:
                job_file.write(job)
                job_file.seek(0)
                if self.stdio:
                    stdin.write(str(inputs[self.first]).encode("utf-8"))
                    stdin.seek(0)
                self.proc = subprocess.Popen(
                    [
                        sys.executable,
                        *PYTHON_FLAGS,
                        os.path.abspath(__file__),
                        "work",
                        str(job_file.fileno()),
                        str(res_w),
                    ],
                    stdin=stdin,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    pass_fds=(job_file.fileno(), res_w),
                    preexec_fn=lambda: _limit_worker(
                        self.limits, len(mine), self.job["nproc_shared"]
                    ),
                )
        finally:
            os.close(res_w)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        cap = self.limits["output_bytes"]
        self.res = _Capped(res_r, (len(mine) + 2) * (3 * cap + 8192))
        self.out = _Capped(self.proc.stdout.fileno(), cap + 1)
        self.err = _Capped(self.proc.stderr.fileno(), cap + 1)
        try:
            self._loop()
        finally:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            if self.job.get("pidns"):
                _kill_everyone_else()
            self.proc.stdout.close()
            self.proc.stderr.close()
            os.close(res_r)
        return self.current

    def _restart_clock(self, allowance: float = 0.0) -> None:
        self.test_started = time.monotonic()
        self.deadline = self.test_started + allowance + self.limits["timeout_s"]

    def _loop(self) -> None:
        self._restart_clock(STARTUP_S)
        sel = selectors.DefaultSelector()
        for reader in (self.res, self.out, self.err):
            sel.register(reader.fd, selectors.EVENT_READ, reader)
        try:
            while self.current <= self.last:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    self._timed_out()
                    return
                for key, _ in sel.select(min(left, 0.05)):
                    key.data.read()
                    if key.data.eof:
                        sel.unregister(key.fd)
                if len(self.out.data) + len(self.err.data) > self.limits["output_bytes"]:
                    self._end_current(
                        OUTPUT_LIMIT,
                        f"the program printed more than {self.limits['output_bytes']} bytes",
                    )
                    return
                if self._parse_reports():
                    return
                if self.proc.poll() is not None:
                    self._worker_ended()
                    return
        finally:
            sel.close()

    def _parse_reports(self) -> bool:
        """Handle the complete lines that arrived; True when this worker is finished."""
        data = self.res.data
        while (end := data.find(b"\n", self.consumed)) >= 0:
            line, self.consumed = bytes(data[self.consumed : end]), end + 1
            tag, _, line = line.partition(b" ")
            if tag != self.nonce.encode():
                continue  # not from the worker's harness code
            try:
                msg = json.loads(line)
            except ValueError:
                continue  # garbage the program wrote on the pipe: ignored
            if isinstance(msg, dict) and self._on_report(msg):
                return True
        return False

    def _on_report(self, msg: dict[str, Any]) -> bool:
        if msg.get("event") == "ready":
            if not self.ready:  # once: a forged "ready" must not restart the clock
                self.ready = True
                self._restart_clock()
            return False
        if msg.get("test") is None:  # about the whole program (its source or top level)
            if msg.get("status") not in WHOLE_PROGRAM:
                return False
            while self.current < self.n:  # the solution never became callable
                self._emit_current(msg)
            return True
        if msg.get("test") != self.current:
            return False  # a duplicate or out-of-order line (possibly forged): not ours
        if self.stdio:
            self.pending = msg  # final once the process has exited and its stdout is drained
            return False
        self._emit_current(msg)
        self._restart_clock()
        return msg.get("status") == OUTPUT_LIMIT  # the worker exits after an output flood

    def _emit_current(self, msg: dict[str, Any]) -> None:
        keep = ("status", "value", "value_repr", "value_json", "error", "detail", "seconds")
        out = {k: msg[k] for k in keep if k in msg}
        out["stdout"] = str(msg.get("stdout") or "") + self.out.text()
        out["stderr"] = self.err.text()
        out.setdefault("seconds", time.monotonic() - self.test_started)
        self.emit({"event": "result", "test": self.current, **out})
        self.current += 1
        self.out.data.clear()
        self.err.data.clear()

    def _end_current(self, status: str, detail: str) -> None:
        """Kill the worker and record the running test as `status`."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()
        for reader in (self.res, self.out, self.err):
            reader.read()
        self._emit_current({"status": status, "detail": detail})

    def _timed_out(self) -> None:
        timeout = self.limits["timeout_s"]
        if self.ready or self.stdio:
            self._end_current(TIMEOUT, f"did not finish within {timeout:g} s (wall clock)")
            return
        self._end_current(TIMEOUT, TOP_LEVEL)
        while self.current < self.n:
            self._emit_current({"status": TIMEOUT, "detail": TOP_LEVEL})

    def _worker_ended(self) -> None:
        for reader in (self.res, self.out, self.err):
            reader.read()
        if self._parse_reports() or self.current > self.last:
            return
        if self.pending is not None:  # stdio: the program finished and reported
            self._emit_current(self.pending)
            return
        code = self.proc.returncode
        status = TIMEOUT if code == -signal.SIGXCPU else EXITED
        self._emit_current({"status": status, "detail": _describe_exit(code, self.limits)})


def _describe_exit(code: int, limits: dict[str, Any]) -> str:
    if code < 0:
        sig = -code
        name = signal.Signals(sig).name if sig in signal.valid_signals() else f"signal {sig}"
        why = {
            signal.SIGXCPU: "CPU time limit exceeded (RLIMIT_CPU)",
            signal.SIGXFSZ: f"file size limit of {limits['scratch_mb']} MiB exceeded",
            signal.SIGSEGV: "segmentation fault (e.g. stack overflow from deep recursion)",
            signal.SIGKILL: "killed (by the program itself, or out of memory)",
        }.get(sig, "killed by a signal")
        return f"the process running the solution died: {name}, {why}"
    return (
        f"the process running the solution ended with exit status {code} before the test "
        "returned (os._exit, or the program closed the harness's file descriptors)"
    )


def _limit_worker(limits: dict[str, Any], tests_left: int, nproc_shared: int | None) -> None:
    import resource

    mem = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    cpu = math.ceil(limits["timeout_s"] * (tests_left + 1)) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if nproc_shared is not None:
        nproc = limits["max_processes"] + nproc_shared
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
    fsize = limits["scratch_mb"] << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _kill_everyone_else() -> None:
    """In our own PID namespace every process but init and us belongs to the program."""
    me = os.getpid()
    for _ in range(200):
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]
        alive = [p for p in pids if not _is_zombie(p)]
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return True  # gone


# ---------------------------------------------------------------------------------------------
# The worker (inside the sandbox; runs the program)
# ---------------------------------------------------------------------------------------------


class _CappedText(io.TextIOBase):
    """sys.stdout/sys.stderr during a test: keeps `cap` characters; past that, the test ends
    as output_limit at once (a flood would otherwise just burn the time limit)."""

    def __init__(self, cap: int, on_overflow: Any) -> None:
        self.cap, self.parts, self.size, self.on_overflow = cap, [], 0, on_overflow

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self.size += len(s)
        if self.size > self.cap:
            self.on_overflow()
        self.parts.append(s)
        return len(s)

    def getvalue(self) -> str:
        return "".join(self.parts)


def _work(job_fd: int, result_fd: int) -> None:
    with os.fdopen(job_fd, "rb") as fh:
        job = json.loads(fh.read())
    root = os.path.dirname(os.path.abspath(__file__))
    source = Path(root, SOLUTION_NAME).read_text(encoding="utf-8", errors="replace")
    lines, entry, cap = source.splitlines(), job["entry_point"], job["output_bytes"]

    nonce = job.pop("nonce") + " "

    def send(msg: dict[str, Any]) -> None:
        _send(result_fd, msg, nonce)

    try:
        code = compile(source, SOLUTION_NAME, "exec")
    except (SyntaxError, ValueError) as exc:  # ValueError: null bytes in the source
        send(
            {
                "status": SYNTAX_ERROR,
                "error": {
                    "type": type(exc).__name__,
                    "message": getattr(exc, "msg", str(exc)),
                    "line": getattr(exc, "lineno", None),
                    "offset": getattr(exc, "offset", None),
                    "text": (getattr(exc, "text", None) or "").rstrip("\n"),
                },
            }
        )
        return
    namespace: dict[str, Any] = {
        "__name__": "__main__" if entry is None else "solution",
        "__file__": SOLUTION_NAME,
        "__builtins__": builtins,
    }
    if entry is None:  # a stdin/stdout program: its stdout (fd 1) is the answer
        send({"event": "ready"})  # the test's clock starts now, not at Python start-up
        status, error, _ = _call(lambda: exec(code, namespace), lines)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
        send({"test": job["first"], "status": status, "error": error})
        return
    status, error, _, out = _captured(lambda: exec(code, namespace), lines, cap, send, None)
    if status != OK:
        send({"status": status, "error": error, "stdout": out, "detail": TOP_LEVEL})
        return
    fn = _resolve(namespace, entry)
    if fn is None:
        defined = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("__"))
        send({"status": MISSING_ENTRY_POINT, "error": {"missing": entry, "defined": defined}})
        return
    send({"event": "ready"})
    for k, args in enumerate(job["inputs"], start=job["first"]):
        call = (lambda a=args: fn(**a)) if isinstance(args, dict) else (lambda a=args: fn(*a))
        started = time.perf_counter()
        status, error, value, out = _captured(call, lines, cap, send, k)
        msg = {
            "test": k,
            "status": status,
            "error": error,
            "stdout": out,
            "seconds": time.perf_counter() - started,
        }
        if status == OK:
            msg.update(_encode_value(value, cap))
        send(msg)


def _resolve(namespace: dict[str, Any], entry: str) -> Any:
    """`name` or `Class.method` (an instance is made with no arguments, LeetCode style)."""
    head, _, method = entry.partition(".")
    obj = namespace.get(head)
    if method and isinstance(obj, type):
        try:
            obj = getattr(obj(), method, None)
        except Exception:
            return None
    return obj if callable(obj) else None


def _captured(
    call: Any, lines: list[str], cap: int, send: Any, test: int | None
) -> tuple[str, dict[str, Any] | None, Any, str]:
    """Run `call` with sys.stdout/sys.stderr captured (capped); (status, error, value, out)."""

    def overflow() -> None:
        send(
            {
                "test": test,
                "status": OUTPUT_LIMIT,
                "detail": f"the program printed more than {cap} characters",
            }
        )
        os._exit(0)  # the supervisor starts a fresh worker for the next test

    out = _CappedText(cap, overflow)
    saved = sys.stdout, sys.stderr
    sys.stdout = sys.stderr = out
    try:
        status, error, value = _call(call, lines)
    finally:
        sys.stdout, sys.stderr = saved
    return status, error, value, out.getvalue()


def _call(call: Any, lines: list[str]) -> tuple[str, dict[str, Any] | None, Any]:
    try:
        return OK, None, call()
    except SystemExit as exc:  # a stdio program may exit(0); anything else is an error
        if exc.code in (None, 0):
            return OK, None, None
        return ERROR, _error_info(exc, lines), None
    except MemoryError as exc:
        return MEMORY_LIMIT, _error_info(exc, lines), None
    except BaseException as exc:  # the program's failure is the result
        return ERROR, _error_info(exc, lines), None


def _error_info(exc: BaseException, lines: list[str]) -> dict[str, Any]:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == SOLUTION_NAME]
    frame = frames[-1] if frames else None
    try:
        message = str(exc)
    except Exception:  # a broken __str__ is the program's, not ours
        message = "<unprintable>"
    line = frame.lineno if frame else None
    text = lines[line - 1].strip() if line and 0 < line <= len(lines) else ""
    return {
        "type": type(exc).__name__,
        "message": message[:1000],
        "line": line,
        "function": frame.name if frame else None,
        "text": text,
    }


def _encode_value(value: Any, cap: int) -> dict[str, Any]:
    try:
        rep = repr(value)[:1000]
    except Exception:
        rep = "<unprintable>"
    try:
        text = json.dumps(value, default=_json_default, allow_nan=True)
    except (TypeError, ValueError, RecursionError):
        return {"value": None, "value_json": False, "value_repr": rep}
    if len(text) > cap:
        return {
            "status": OUTPUT_LIMIT,
            "value_repr": rep[:200],
            "detail": f"the return value is larger than {cap} bytes",
        }
    return {"value": json.loads(text), "value_repr": rep}


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        try:
            return sorted(obj)
        except TypeError:
            return list(obj)
    raise TypeError(type(obj).__name__)


def _main(argv: list[str]) -> None:
    if argv[:1] == ["supervise"]:
        _supervise(int(argv[1]))
    elif argv[:1] == ["work"]:
        _work(int(argv[1]), int(argv[2]))
    else:
        raise SystemExit("usage: harness.py supervise REPORT_FD | work JOB_FD RESULT_FD")


if __name__ == "__main__":
    _main(sys.argv[1:])
