"""`TraceStore`: the trace & lineage store. A SQLite file by default (``RUN_DIR/traces.db``),
any SQLAlchemy URL (e.g. PostgreSQL) by config; migrated to the newest schema on open.

Every read returns plain JSON-ready dicts (datetimes as ISO-8601 UTC strings), so what a read
returns can be written to a file and replayed without the database.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

from sqlalchemy import create_engine, delete, event, select
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, NoSuchModuleError
from sqlalchemy.orm import Session, selectinload, sessionmaker
from sqlalchemy.pool import StaticPool

from selfdistill.errors import UserError
from selfdistill.store import records
from selfdistill.store.migrations import upgrade
from selfdistill.store.models import (
    Attempt,
    Checkpoint,
    Run,
    StepAttempt,
    TrainingStep,
)
from selfdistill.store.writer import TraceWriter

DB_FILENAME = "traces.db"
"""The store's file name inside a run directory."""


def _sqlite_on_connect(dbapi_conn: Any, _record: Any) -> None:
    # pysqlite's own transaction handling skips BEGIN before DDL and delays it before DML, which
    # makes migrations non-atomic; turn it off and let the "begin" event below emit BEGIN.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA foreign_keys=ON")  # off by default in SQLite, per connection
    cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer thread
    cur.execute("PRAGMA synchronous=NORMAL")  # durable across a process crash in WAL mode
    cur.close()


def _sqlite_on_begin(conn: Any) -> None:
    # "IMMEDIATE" (asked for by `migrations.upgrade`) takes the write lock at once, so two
    # processes opening one new file queue up instead of both creating the tables.
    conn.exec_driver_sql(f"BEGIN {conn.get_execution_options().get('sqlite_begin', '')}")


def _make_engine(url: URL) -> Engine:
    backend = url.get_backend_name()
    if backend == "sqlite":
        in_memory = url.database in (None, "", ":memory:")
        engine = create_engine(
            url,
            # Pooled connections move between the caller and the writer thread, one at a time.
            connect_args={"check_same_thread": False, "timeout": 30},
            # An in-memory database exists once per connection: keep exactly one. Quick tests
            # only: the writer thread would share that connection, so use a file with writer().
            **({"poolclass": StaticPool} if in_memory else {}),
        )
        event.listen(engine, "connect", _sqlite_on_connect)
        event.listen(engine, "begin", _sqlite_on_begin)
        return engine
    connect_args = {}
    if backend == "postgresql" and "connect_timeout" not in url.query:
        connect_args["connect_timeout"] = 10  # fail with a message, not a hang
    return create_engine(url, connect_args=connect_args, pool_pre_ping=True)


def resolve_url(url: str | None = None, path: str | Path | None = None) -> URL:
    """The store's URL: `url` as given, or a SQLite file at `path`. A `path` that is a
    directory, or does not exist and has no suffix, is a run directory: ``path/traces.db``
    (created if need be). Exactly one of `url` and `path`."""
    if (url is None) == (path is None):
        raise UserError("trace store: give either a database URL or a file path, not both/none")
    if url is not None:
        try:
            return make_url(url)
        except ArgumentError as exc:
            raise UserError(
                f"trace store URL {url!r} is not a database URL ({exc}); use e.g. "
                "'postgresql+psycopg://user@host:5432/db' or a file path"
            ) from None
    p = Path(path).expanduser()  # type: ignore[arg-type]
    if p.is_dir() or (not p.exists() and not p.suffix):
        p = p / DB_FILENAME
    p.parent.mkdir(parents=True, exist_ok=True)
    return URL.create("sqlite", database=str(p.resolve()))


class TraceStore:
    """Records runs, attempts, feedback, teacher contexts, training steps and checkpoints.

    ``TraceStore(path=RUN_DIR)`` opens (or creates) ``RUN_DIR/traces.db``;
    ``TraceStore("postgresql+psycopg://postgres@127.0.0.1:5432/db")`` a server database. The
    schema is migrated to the newest revision on open. Writes are synchronous, one transaction
    per call; for the trainer's hot path use `writer()`.
    """

    def __init__(self, url: str | None = None, *, path: str | Path | None = None) -> None:
        self.url = resolve_url(url, path)
        shown = self.url.render_as_string(hide_password=True)
        try:
            self.engine = _make_engine(self.url)
        except NoSuchModuleError:
            raise UserError(
                f"trace store {shown}: unknown database kind {self.url.drivername!r}; "
                "use sqlite:///FILE or postgresql+psycopg://..."
            ) from None
        except ModuleNotFoundError as exc:
            raise UserError(
                f"trace store {shown}: the database driver is not installed ({exc.name}); "
                "install it, e.g. pip install 'psycopg[binary]'"
            ) from None
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)
        try:
            upgrade(self.engine)
        except DBAPIError as exc:
            self.engine.dispose()
            raise UserError(
                f"cannot open the trace store {shown}: {str(exc.orig).strip()}; check the URL "
                "or path, and that the database server is running"
            ) from None
        except BaseException:
            self.engine.dispose()
            raise

    def __repr__(self) -> str:
        return f"TraceStore({self.url.render_as_string(hide_password=True)!r})"

    def close(self) -> None:
        """Close the store's connections."""
        self.engine.dispose()

    def __enter__(self) -> TraceStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def session(self) -> Session:
        """A new ORM session on this store (for queries this class does not offer)."""
        return self._sessions()

    # -- writes ---------------------------------------------------------------------------------

    def _write(self, plan: records.WritePlan) -> list[str]:
        with self._sessions.begin() as session:
            plan.apply(session)
        return plan.ids

    def create_run(
        self,
        name: str,
        *,
        scope: str = "global",
        config: Mapping[str, Any] | None = None,
        status: str = "running",
        run_id: str | None = None,
    ) -> str:
        """Record a new run; `scope` is whose adapter it trains ("global", "user:alice", ...).
        Returns its id (`run_id` if given, else a new one)."""
        plan = records.plan_run(name, scope=scope, config=config, status=status, run_id=run_id)
        return self._write(plan)[0]

    def set_run_status(self, run_id: str, status: str) -> None:
        """Change a run's status, e.g. to "finished" or "failed"."""
        self._write(records.plan_run_status(run_id, status))

    def add_attempts(self, run_id: str, attempts: Iterable[Mapping[str, Any]]) -> list[str]:
        """Record attempts (see `records.plan_attempts` for the keys); returns their ids."""
        return self._write(records.plan_attempts(run_id, attempts))

    def add_feedback(self, feedback: Iterable[Mapping[str, Any]]) -> list[str]:
        """Record feedback (see `records.plan_feedback` for the keys); returns their ids."""
        return self._write(records.plan_feedback(feedback))

    def add_teacher_contexts(self, contexts: Iterable[Mapping[str, Any]]) -> list[str]:
        """Record teacher contexts (see `records.plan_teacher_contexts`); returns their ids."""
        return self._write(records.plan_teacher_contexts(contexts))

    def record_step(
        self,
        run_id: str,
        step: int,
        attempt_ids: Sequence[str],
        *,
        loss: float | None = None,
        metrics: Mapping[str, Any] | None = None,
        token_credit: Mapping[str, Mapping[str, Any]] | None = None,
        checkpoint_before: str | None = None,
        checkpoint_after: str | None = None,
    ) -> str:
        """Record training step `step` and the attempts it consumed, in batch order.

        `token_credit` maps an attempt id to its per-token advantage summary (the "token" credit
        scope; `records.summarize_token_credit` makes one). A second step with the same number
        in the run raises `sqlalchemy.exc.IntegrityError` (use `rewind` when resuming).
        """
        plan = records.plan_step(
            run_id, step, attempt_ids, loss=loss, metrics=metrics, token_credit=token_credit,
            checkpoint_before=checkpoint_before, checkpoint_after=checkpoint_after,
        )  # fmt: skip
        return self._write(plan)[0]

    def record_checkpoint(
        self, run_id: str, step: int, path: str | Path, *, weights_sha256: str | None = None
    ) -> str:
        """Record the checkpoint written after `step`; returns its id."""
        plan = records.plan_checkpoint(run_id, step, path, weights_sha256=weights_sha256)
        return self._write(plan)[0]

    def rewind(self, run_id: str, step: int) -> dict[str, int]:
        """Forget everything of a run after training step `step`, before resuming from the
        checkpoint of `step`: later training steps, checkpoints, and attempts sampled by later
        rollouts (with their feedback and teacher contexts). Returns rows deleted per table."""
        deleted: dict[str, int] = {}
        with self._sessions.begin() as session:
            for model in (TrainingStep, Checkpoint, Attempt):
                stmt = delete(model).where(model.run_id == run_id, model.step > step)
                deleted[model.__tablename__] = session.execute(stmt).rowcount  # type: ignore[attr-defined]
        return deleted

    def writer(self) -> TraceWriter:
        """A background writer (one daemon thread, one transaction per training step)."""
        if self.url.get_backend_name() == "sqlite" and self.url.database in (None, "", ":memory:"):
            raise UserError("an in-memory trace store has one connection: use a file for writer()")
        return TraceWriter(self)

    # -- reads ----------------------------------------------------------------------------------

    def get_run(self, run_id: str) -> dict[str, Any]:
        """The run with this id; UserError if there is none."""
        with self._sessions() as session:
            run = session.get(Run, run_id)
            if run is None:
                raise UserError(f"no run {run_id!r} in the trace store {self!r}")
            return run.as_dict()

    def runs(self, *, scope: str | None = None) -> list[dict[str, Any]]:
        """All runs (of one `scope` if given), oldest first."""
        stmt = select(Run).order_by(Run.created_at, Run.id)
        if scope is not None:
            stmt = stmt.where(Run.scope == scope)
        with self._sessions() as session:
            return [r.as_dict() for r in session.scalars(stmt)]

    def find_run(self, ref: str) -> dict[str, Any]:
        """A run by id, or by name when exactly one run has that name."""
        with self._sessions() as session:
            run = session.get(Run, ref)
            if run is not None:
                return run.as_dict()
            named = session.scalars(select(Run).where(Run.name == ref).limit(2)).all()
        if len(named) == 1:
            return named[0].as_dict()
        problem = "several runs are" if named else "no run is"
        raise UserError(f"{problem} named or numbered {ref!r} in {self!r}; pass a run id")

    def steps(self, run_id: str) -> list[dict[str, Any]]:
        """The run's training steps in order, each with ``attempt_ids`` in batch order."""
        with self._sessions() as session:
            stmt = (
                select(TrainingStep)
                .where(TrainingStep.run_id == run_id)
                .order_by(TrainingStep.step)
                .options(selectinload(TrainingStep.attempt_links))
            )
            return [
                {**ts.as_dict(), "attempt_ids": [link.attempt_id for link in ts.attempt_links]}
                for ts in session.scalars(stmt)
            ]

    def step_batch(self, run_id: str, step: int) -> dict[str, Any]:
        """Everything needed to rebuild one training step's batch.

        Returns ``{"run", "step", "checkpoint_before", "attempts"}``: the step (with
        ``attempt_ids``), the `Checkpoint` its ``checkpoint_before`` names (by id or path; None
        when it names something else, e.g. the base model), and the attempts in batch order,
        each with its ``feedback``, ``teacher_contexts`` and this step's ``token_credit``.
        """
        with self._sessions() as session:
            stmt = (
                select(TrainingStep)
                .where(TrainingStep.run_id == run_id, TrainingStep.step == step)
                .options(
                    selectinload(TrainingStep.attempt_links)
                    .selectinload(StepAttempt.attempt)
                    .options(selectinload(Attempt.feedback), selectinload(Attempt.teacher_contexts))
                )
            )
            ts = session.scalars(stmt).one_or_none()
            if ts is None:
                raise UserError(f"run {run_id!r} has no training step {step} in {self!r}")
            before = None
            if ts.checkpoint_before is not None:
                ref = ts.checkpoint_before
                before = session.scalars(
                    select(Checkpoint).where(
                        Checkpoint.run_id == run_id,
                        (Checkpoint.id == ref) | (Checkpoint.path == ref),
                    )
                ).first()
            attempts = [
                {**_attempt_dict(link.attempt), "token_credit": link.token_credit}
                for link in ts.attempt_links
            ]
            run = session.get(Run, run_id)
            return {
                "run": None if run is None else run.as_dict(),
                "step": {**ts.as_dict(), "attempt_ids": [a["id"] for a in attempts]},
                "checkpoint_before": None if before is None else before.as_dict(),
                "attempts": attempts,
            }

    def attempts_consumed(self, run_id: str, *, up_to_step: int | None = None) -> list[str]:
        """Ids of the attempts that training steps ``<= up_to_step`` consumed (all steps when
        None), in training order, each once: the evidence behind that step's checkpoint."""
        stmt = (
            select(StepAttempt.attempt_id)
            .join(TrainingStep)
            .where(TrainingStep.run_id == run_id)
            .order_by(TrainingStep.step, StepAttempt.position)
        )
        if up_to_step is not None:
            stmt = stmt.where(TrainingStep.step <= up_to_step)
        with self._sessions() as session:
            return list(dict.fromkeys(session.scalars(stmt)))

    def export_jsonl(self, run_id: str, out: str | Path | IO[str]) -> int:
        """Write one JSON object per attempt of the run (oldest first) with its ``feedback``,
        ``teacher_contexts`` and ``consumed_by`` (the steps that trained on it: step number,
        step id, token credit). `out` is a path or an open text file. Returns the count."""
        self.get_run(run_id)  # an unknown run is an error, not an empty file
        if isinstance(out, str | Path):
            with open(out, "w", encoding="utf-8") as fh:
                return self.export_jsonl(run_id, fh)
        stmt = (
            select(Attempt)
            .where(Attempt.run_id == run_id)
            .order_by(Attempt.created_at, Attempt.id)
            .options(
                selectinload(Attempt.feedback),
                selectinload(Attempt.teacher_contexts),
                selectinload(Attempt.step_links).selectinload(StepAttempt.training_step),
            )
            .execution_options(yield_per=500)  # stream: a run can hold millions of attempts
        )
        n = 0
        with self._sessions() as session:
            for attempt in session.scalars(stmt):
                links = sorted(attempt.step_links, key=lambda link: link.training_step.step)
                consumed = [
                    {
                        "step": link.training_step.step,
                        "step_id": link.step_id,
                        "token_credit": link.token_credit,
                    }
                    for link in links
                ]
                obj = {**_attempt_dict(attempt), "consumed_by": consumed}
                out.write(json.dumps(obj, ensure_ascii=False) + "\n")
                n += 1
        return n


def _attempt_dict(attempt: Attempt) -> dict[str, Any]:
    return {
        **attempt.as_dict(),
        "feedback": [f.as_dict() for f in attempt.feedback],
        "teacher_contexts": [c.as_dict() for c in attempt.teacher_contexts],
    }
