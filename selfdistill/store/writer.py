"""A background writer: the trainer's hot path hands records over and goes on; one daemon thread
commits them, one transaction per training step.

Protocol, per training step::

    w = store.writer()
    ids = w.add_attempts(run_id, [...])      # ids are known at once; nothing touches the DB
    w.add_feedback([...]); w.record_step(run_id, step, ids, loss=...)
    w.end_step()                             # hand the step over; returns at once unless the
                                             # previous step is still being written
    ...
    w.flush()                                # wait until everything so far is committed
    w.close()

Guarantees: a step is committed whole or not at all. After `end_step()` returns, every earlier
step is committed, so a crash loses at most the step being committed and the one being built;
after `flush()` returns, nothing submitted before it can be lost. If a transaction fails, that
step is rolled back, later steps are dropped (they may refer to its rows), and every following
call raises `TraceWriteError`; make a new writer to go on.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session

from selfdistill.store import records
from selfdistill.store.models import Base

if TYPE_CHECKING:
    from selfdistill.store.store import TraceStore


class TraceWriteError(RuntimeError):
    """A background transaction failed; its step was not written (the cause is chained)."""


def _as_apply(item: object) -> records.Apply:
    if callable(item):
        return item  # type: ignore[return-value]
    if isinstance(item, Iterable) and not isinstance(item, str | bytes | Mapping):
        objs = list(item)
        if all(isinstance(o, Base) for o in objs):
            return lambda session: session.add_all(objs)
    raise TypeError(
        f"submit() takes a function of a Session or a list of ORM records, got {type(item)}"
    )


class TraceWriter:
    """Writes to a `TraceStore` from one daemon thread; see the module docstring."""

    def __init__(self, store: TraceStore) -> None:
        self._store = store
        self._pending: list[records.Apply] = []
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue[list[records.Apply] | None] = queue.Queue()
        self._cond = threading.Condition()
        self._sent = 0  # steps handed to the thread
        self._done = 0  # steps the thread has finished (committed, or dropped after an error)
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(
            target=self._loop, name="selfdistill-trace-writer", daemon=True
        )
        self._thread.start()

    # -- handing records over (never touches the database) ---------------------------------

    def submit(self, item: object) -> None:
        """Add work to the current step: a function ``f(session)`` run inside the step's
        transaction, or a list of ORM records (do not modify them after submitting)."""
        self._check()
        apply = _as_apply(item)
        with self._pending_lock:
            self._pending.append(apply)

    def _plan(self, plan: records.WritePlan) -> list[str]:
        self.submit(plan.apply)
        return plan.ids

    def add_attempts(self, run_id: str, attempts: Iterable[Mapping[str, Any]]) -> list[str]:
        """Queue attempts (see `TraceStore.add_attempts`); returns their ids."""
        return self._plan(records.plan_attempts(run_id, attempts))

    def add_feedback(self, feedback: Iterable[Mapping[str, Any]]) -> list[str]:
        """Queue feedback (see `TraceStore.add_feedback`); returns their ids."""
        return self._plan(records.plan_feedback(feedback))

    def add_teacher_contexts(self, contexts: Iterable[Mapping[str, Any]]) -> list[str]:
        """Queue teacher contexts (see `TraceStore.add_teacher_contexts`); returns their ids."""
        return self._plan(records.plan_teacher_contexts(contexts))

    def record_step(self, run_id: str, step: int, attempt_ids: Sequence[str], **kw: Any) -> str:
        """Queue a training step (see `TraceStore.record_step`); returns its id."""
        return self._plan(records.plan_step(run_id, step, attempt_ids, **kw))[0]

    def record_checkpoint(
        self, run_id: str, step: int, path: str | Path, *, weights_sha256: str | None = None
    ) -> str:
        """Queue a checkpoint (see `TraceStore.record_checkpoint`); returns its id."""
        plan = records.plan_checkpoint(run_id, step, path, weights_sha256=weights_sha256)
        return self._plan(plan)[0]

    # -- step boundaries ---------------------------------------------------------------------

    def end_step(self, timeout: float | None = None) -> None:
        """Close the current step (committed as one transaction in the background). Waits only
        while the previous step is still being written, so at most one step is in flight."""
        self._send()
        self._wait(lag=1, timeout=timeout)

    def flush(self, timeout: float | None = None) -> None:
        """Close the current step and wait until everything submitted so far is committed."""
        self._send()
        self._wait(lag=0, timeout=timeout)

    def close(self, *, commit_pending: bool = True) -> None:
        """Flush (or, with ``commit_pending=False``, drop the unfinished step) and stop the
        thread. Steps already handed over with `end_step` are written either way."""
        if self._closed:
            return
        try:
            if commit_pending and self._error is None:
                self._send()
            else:
                with self._pending_lock:
                    self._pending = []
        finally:
            self._closed = True
            self._queue.put(None)  # the thread finishes what it was handed, then stops
            self._thread.join()
        self._check(closing=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
            return
        # A step interrupted by an exception is incomplete: do not commit half of it. A write
        # error found now must not hide the exception already on its way out.
        with contextlib.suppress(TraceWriteError):
            self.close(commit_pending=False)

    # -- internals ------------------------------------------------------------------------------

    def _check(self, *, closing: bool = False) -> None:
        if self._error is not None:
            raise TraceWriteError(f"writing traces failed: {self._error}") from self._error
        if self._closed and not closing:
            raise TraceWriteError("this trace writer is closed")

    def _send(self) -> None:
        self._check()
        with self._pending_lock:
            batch, self._pending = self._pending, []
        if not batch:
            return  # an empty step needs no transaction
        with self._cond:
            self._sent += 1
        self._queue.put(batch)

    def _wait(self, *, lag: int, timeout: float | None) -> None:
        with self._cond:
            done = self._cond.wait_for(
                lambda: self._error is not None or self._done >= self._sent - lag, timeout
            )
        self._check()
        if not done:
            raise TimeoutError(f"trace writer: steps still unwritten after {timeout} s")

    def _loop(self) -> None:
        while (batch := self._queue.get()) is not None:
            if self._error is None:
                try:
                    with Session(self._store.engine) as session, session.begin():
                        for apply in batch:
                            apply(session)
                except BaseException as exc:  # re-raised on the caller's thread
                    with self._cond:
                        self._error = exc
            with self._cond:
                self._done += 1
                self._cond.notify_all()
