"""The trace store, on both backends: a SQLite file, and a fresh PostgreSQL database per test.

PostgreSQL tests skip only when CI is unset and no server answers; with CI set they fail instead.
The server is SELFDISTILL_TEST_PG_URL (default: postgres on 127.0.0.1:5432, trust auth).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import secrets
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from sqlalchemy import create_engine, inspect
from sqlalchemy.exc import IntegrityError, OperationalError

from selfdistill.errors import UserError
from selfdistill.store import (
    TraceStore,
    TraceWriteError,
    new_id,
    summarize_token_credit,
)
from selfdistill.store.cli import add_subcommand
from selfdistill.store.models import Base, Run
from selfdistill.store.records import check_scope

PG_ADMIN_URL = os.environ.get(
    "SELFDISTILL_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
REPO = Path(__file__).resolve().parents[1]
TABLES = {
    "runs", "attempts", "feedback", "teacher_contexts", "training_steps", "step_attempts",
    "checkpoints", "alembic_version",
    "adapter_versions", "adapter_scopes", "adapter_activations", "adapter_gate_runs",
    "serve_tenants", "serve_completions", "serve_lessons", "serve_rounds", "serve_deletions",
}  # fmt: skip


@pytest.fixture(scope="session")
def pg_admin():
    """An autocommit engine on the server's `postgres` database (to create/drop databases)."""
    engine = create_engine(
        PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
    )
    try:
        with engine.connect():
            pass
    except OperationalError as exc:
        engine.dispose()
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but PostgreSQL at {PG_ADMIN_URL} is unreachable: {exc}")
        pytest.skip(f"no PostgreSQL answers at {PG_ADMIN_URL} and CI is unset (CI=true: fail)")
    yield engine
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    """A URL of an empty database: a SQLite file, or a fresh PostgreSQL database (dropped after)."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'traces.db'}"
        return
    admin = request.getfixturevalue("pg_admin")
    name = f"selfdistill_test_{secrets.token_hex(6)}"
    with admin.connect() as conn:
        conn.exec_driver_sql(f'CREATE DATABASE "{name}"')
    try:
        yield admin.url.set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def store(db_url):
    s = TraceStore(db_url)
    yield s
    s.close()


def _attempt(k: int, i: int, **extra) -> dict:
    return {
        "prompt": [
            {"role": "system", "content": "Answer in one word."},
            {"role": "user", "content": f"héllo ✓ step {k} #{i}"},
        ],
        "completion": f"answer {k}.{i}\n",
        "completion_ids": [k, i, 49151],
        **extra,
    }


def _strip(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in {"id", "created_at", *keys}}


# -- schema -----------------------------------------------------------------------------------


def test_migrations_create_schema_matching_the_models(db_url):
    from alembic import command
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from selfdistill.store.migrations import alembic_config, current_revision, head_revision

    engine = create_engine(db_url)
    assert set(inspect(engine).get_table_names()) == set()
    TraceStore(db_url).close()
    TraceStore(db_url).close()  # reopening an up-to-date store is a no-op
    assert set(inspect(engine).get_table_names()) == TABLES

    def diff():
        with engine.connect() as conn:
            ctx = MigrationContext.configure(conn, opts={"compare_type": True})
            return compare_metadata(ctx, Base.metadata)

    with engine.connect() as conn:
        assert current_revision(conn) == head_revision()
    assert diff() == []  # the migrations build exactly the ORM's schema
    with engine.begin() as conn:  # the comparison does notice a difference
        conn.exec_driver_sql("DROP INDEX ix_attempts_group_id")
    assert [d[0] for d in diff()] == ["add_index"]

    with engine.begin() as conn:
        cfg = alembic_config()
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "base")
    assert set(inspect(engine).get_table_names()) == {"alembic_version"}
    engine.dispose()


def test_processes_opening_a_new_store_at_once_all_succeed(db_url):
    # Without the migration lock (BEGIN IMMEDIATE on SQLite, an advisory lock on PostgreSQL)
    # most rounds of this end in "database is locked" or "already exists".
    code = "import sys; from selfdistill.store import TraceStore; TraceStore(sys.argv[1]).close()"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, db_url], stderr=subprocess.PIPE, env=env)
        for _ in range(2)
    ]
    errors = [p.communicate(timeout=60)[1].decode()[-500:] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], errors


def test_unknown_or_unreachable_store_is_a_user_error(tmp_path):
    for url, words in [
        ("postgresql+psycopg://postgres@127.0.0.1:1/nope", "cannot open"),  # port 1: refused
        ("nosuchdb://x/y", "unknown database kind"),
        ("not a url at all://", "not a database URL"),
    ]:
        with pytest.raises(UserError, match=words):
            TraceStore(url)
    with pytest.raises(UserError, match="either"):
        TraceStore()
    memory = TraceStore("sqlite://")  # in memory: synchronous use only
    assert memory.runs() == [] and memory.get_run(memory.create_run("m"))["name"] == "m"
    with pytest.raises(UserError, match="in-memory"):
        memory.writer()


def test_sqlite_pragmas_and_foreign_keys(tmp_path):
    run_dir = tmp_path / "run1"
    s = TraceStore(path=run_dir)  # a directory → run_dir/traces.db
    assert (run_dir / "traces.db").is_file()
    with s.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    with pytest.raises(IntegrityError):
        s.add_feedback([{"attempt_id": "no-such-attempt", "kind": "test_failure"}])
    with pytest.raises(IntegrityError):
        s.add_attempts("no-such-run", [_attempt(0, 0)])
    s.close()


def test_runs_by_scope_and_nulls(store):
    alice = store.create_run("a", scope="user:alice")
    store.create_run("g")
    assert [r["id"] for r in store.runs(scope="user:alice")] == [alice]
    assert len(store.runs()) == 2
    store.add_attempts(alice, [_attempt(0, 0), _attempt(0, 1, logprobs=[-1.0])])
    with store.engine.connect() as conn:  # absent log-probs are SQL NULL, not JSON 'null'
        nulls = conn.exec_driver_sql("SELECT count(*) FROM attempts WHERE logprobs IS NULL")
        assert nulls.scalar() == 1


def test_unique_run_step_and_rewind(store):
    run = store.create_run("r")
    ids = store.add_attempts(run, [_attempt(1, 0, step=1), _attempt(2, 0, step=2)])
    store.record_step(run, 1, ids[:1])
    store.record_checkpoint(run, 1, "/ck/1")
    with pytest.raises(IntegrityError):
        store.record_step(run, 1, ids[1:])
    with pytest.raises(IntegrityError):
        store.record_checkpoint(run, 1, "/ck/1-again")
    other = store.create_run("other")  # the same step number in another run is fine
    store.record_step(other, 1, [])

    store.record_step(run, 2, ids[1:])
    store.record_checkpoint(run, 2, "/ck/2")
    deleted = store.rewind(run, 1)
    assert deleted == {"training_steps": 1, "checkpoints": 1, "attempts": 1}
    assert [s["step"] for s in store.steps(run)] == [1]
    store.record_step(run, 2, ids[:1])  # re-recording after a rewind is allowed
    assert store.steps(run)[1]["attempt_ids"] == ids[:1]


def test_bad_records_fail_on_the_callers_side(store):
    run = store.create_run("r")
    [aid] = store.add_attempts(run, [_attempt(0, 0)])
    with pytest.raises(ValueError, match="credit_scope"):
        store.add_feedback([{"attempt_id": aid, "kind": "x", "credit_scope": "everything"}])
    with pytest.raises(ValueError, match="unknown"):
        store.add_attempts(run, [{**_attempt(0, 1), "complettion": "typo"}])
    with pytest.raises(ValueError, match="not in the batch"):
        store.record_step(run, 1, [aid], token_credit={"other": {"n": 1}})
    with pytest.raises(UserError, match="scope"):
        store.create_run("r", scope="user:")
    assert check_scope("workspace:x") == "workspace:x"


# -- round trip -------------------------------------------------------------------------------


def _write_run(store):
    """A full run: two rollout steps, feedback, teacher contexts, two training steps."""
    run = store.create_run(
        "sdpo-demo", scope="user:alice", config={"lr": 1e-5, "teacher": {"regime": "ema"}}
    )
    a0 = [
        _attempt(0, i, step=0, group_id="g0", sampler_version="base",
                 prompt_source=f"data.jsonl:{i + 1}", logprobs=[-0.1, -2.5e-8, -13.25])
        for i in range(3)
    ]  # fmt: skip
    a0[0]["id"] = "caller-chosen-id"
    ids0 = store.add_attempts(run, a0)
    fb = [
        {"attempt_id": ids0[0], "kind": "test_failure", "text": "assert f(2) == 4\nAssertionError",
         "reward": 0.0, "passed": False, "evidence": {"test": "test_f", "stdout": "", "rc": 1},
         "credit_scope": "artifact", "artifact": "tests/test_f.py::test_f"},
        {"attempt_id": ids0[0], "kind": "reviewer_note", "text": "off by one", "reward": -0.5,
         "credit_scope": "token"},
        {"attempt_id": ids0[1], "kind": "solution", "text": "return x * 2", "reward": 1.0,
         "passed": True},
    ]  # fmt: skip
    fb_ids = store.add_feedback(fb)
    ctx = [
        {"attempt_id": ids0[0], "kinds": ["test_failure", "reviewer_note"],
         "feedback_ids": fb_ids[:2], "truncated_tokens": 7,
         "messages": [{"role": "user", "content": "task + feedback"}]},
        {"attempt_id": ids0[1], "kinds": ["solution"], "feedback_ids": fb_ids[2:],
         "messages": [{"role": "user", "content": "task + solution"}]},
    ]  # fmt: skip
    store.add_teacher_contexts(ctx)
    ck0 = store.record_checkpoint(run, 0, "runs/x/ckpt-0", weights_sha256="ab" * 32)
    batch1 = [ids0[1], ids0[0]]  # batch order differs from insertion order on purpose
    credit = {ids0[0]: summarize_token_credit([0.5, -2.0, 0.25])}
    store.record_step(
        run, 1, batch1, loss=1.2345678901234567, metrics={"kl": 0.03, "tokens": 57},
        token_credit=credit, checkpoint_before=ck0, checkpoint_after="runs/x/ckpt-1",
    )  # fmt: skip
    ids1 = store.add_attempts(run, [_attempt(1, 0, step=1)])
    store.record_step(run, 2, [ids0[0], *ids1], checkpoint_before="runs/x/ckpt-1")
    return run, ids0, ids1, a0, fb, ctx, credit, ck0


def test_round_trip_and_step_batch(store):
    run, ids0, ids1, a0, fb, ctx, credit, ck0 = _write_run(store)
    assert ids0[0] == "caller-chosen-id"
    assert store.get_run(run)["config"] == {"lr": 1e-5, "teacher": {"regime": "ema"}}
    assert store.get_run(run)["created_at"].endswith("+00:00")  # aware UTC on every backend
    assert [(s["step"], s["attempt_ids"]) for s in store.steps(run)] == [
        (1, [ids0[1], ids0[0]]),
        (2, [ids0[0], ids1[0]]),
    ]

    batch = store.step_batch(run, 1)
    assert batch["run"]["scope"] == "user:alice"
    assert _strip(batch["step"]) == {
        "run_id": run, "step": 1, "loss": 1.2345678901234567,
        "metrics": {"kl": 0.03, "tokens": 57}, "checkpoint_before": ck0,
        "checkpoint_after": "runs/x/ckpt-1", "attempt_ids": [ids0[1], ids0[0]],
    }  # fmt: skip
    assert batch["checkpoint_before"]["id"] == ck0
    assert batch["checkpoint_before"]["weights_sha256"] == "ab" * 32
    second, first = batch["attempts"]
    skip = ("run_id", "feedback", "teacher_contexts", "token_credit")
    assert _strip(first, *skip) == _strip(a0[0])
    assert _strip(second, *skip) == _strip(a0[1])
    assert first["token_credit"] == credit[ids0[0]] and second["token_credit"] is None

    defaults = {"reward": None, "passed": None, "evidence": {}, "artifact": None}
    assert [_strip(f) for f in first["feedback"]] == [
        {**defaults, "credit_scope": "rollout", **fb[0]},
        {**defaults, **fb[1]},
    ]
    assert [_strip(f) for f in second["feedback"]] == [
        {**defaults, "credit_scope": "rollout", "evidence": {}, **fb[2]}
    ]
    assert [_strip(c) for c in first["teacher_contexts"]] == [ctx[0]]
    assert [_strip(c) for c in second["teacher_contexts"]] == [{"truncated_tokens": 0, **ctx[1]}]

    # "runs/x/ckpt-1" was never recorded as a Checkpoint: the reference stays, unresolved
    assert store.step_batch(run, 2)["checkpoint_before"] is None
    assert store.attempts_consumed(run, up_to_step=1) == [ids0[1], ids0[0]]
    assert store.attempts_consumed(run) == [ids0[1], ids0[0], ids1[0]]
    with pytest.raises(UserError, match="no training step 3"):
        store.step_batch(run, 3)


def test_export_jsonl(store):
    run, ids0, ids1, *_ = _write_run(store)
    buf = io.StringIO()
    assert store.export_jsonl(run, buf) == 4
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    assert [r["id"] for r in rows] == [*ids0, *ids1]  # creation order
    by_id = {r["id"]: r for r in rows}
    consumed = {aid: [(c["step"], c["token_credit"]) for c in r["consumed_by"]]
                for aid, r in by_id.items()}  # fmt: skip
    assert consumed == {
        ids0[0]: [(1, summarize_token_credit([0.5, -2.0, 0.25])), (2, None)],
        ids0[1]: [(1, None)],
        ids0[2]: [],
        ids1[0]: [(2, None)],
    }
    assert [f["kind"] for f in by_id[ids0[0]]["feedback"]] == ["test_failure", "reviewer_note"]
    assert by_id[ids0[0]]["teacher_contexts"][0]["truncated_tokens"] == 7
    assert by_id[ids0[0]]["prompt"][1]["content"] == "héllo ✓ step 0 #0"
    with pytest.raises(UserError, match="no run"):
        store.export_jsonl("nope", io.StringIO())


# -- background writer ------------------------------------------------------------------------


def _writer_step(w, run: str, k: int, n: int = 2) -> list[str]:
    ids = w.add_attempts(run, [_attempt(k, i, step=k) for i in range(n)])
    w.add_feedback([{"attempt_id": a, "kind": "runtime_error", "text": f"s{k}"} for a in ids])
    w.add_teacher_contexts([{"attempt_id": a, "messages": [f"ctx {k}"]} for a in ids])
    w.record_step(run, k, ids, loss=float(k))
    return ids


def test_writer_flushed_records_are_visible_from_a_new_store(db_url):
    s = TraceStore(db_url)
    run = s.create_run("w")
    w = s.writer()
    ids1 = _writer_step(w, run, 1)
    w.end_step()
    ids2 = _writer_step(w, run, 2)
    w.submit([Run(id="orm-run", name="via ORM", scope="global", status="x", config={})])
    w.submit(lambda session: session.add(Run(id="fn-run", name="fn", scope="global",
                                             status="x", config={})))  # fmt: skip
    w.flush()
    fresh = TraceStore(db_url)
    assert [st["attempt_ids"] for st in fresh.steps(run)] == [ids1, ids2]
    assert [f["text"] for f in fresh.step_batch(run, 2)["attempts"][1]["feedback"]] == ["s2"]
    assert {r["id"] for r in fresh.runs()} == {run, "orm-run", "fn-run"}
    w.close()
    with pytest.raises(TraceWriteError, match="closed"):
        w.submit(lambda session: None)
    fresh.close()
    s.close()


def test_writer_unfinished_step_is_lost_whole(db_url):
    s = TraceStore(db_url)
    run = s.create_run("w")
    w = s.writer()
    _writer_step(w, run, 1)
    w.end_step()  # handed over: written even though the writer is closed without flushing
    _writer_step(w, run, 2)  # never handed over: the "in-flight" step of a crash
    w.close(commit_pending=False)
    fresh = TraceStore(db_url)
    assert [st["step"] for st in fresh.steps(run)] == [1]
    buf = io.StringIO()
    assert fresh.export_jsonl(run, buf) == 2  # step 2's attempts are gone too
    fresh.close()
    s.close()


def test_writer_failed_transaction_rolls_back_its_step_and_raises(db_url):
    s = TraceStore(db_url)
    run = s.create_run("w")
    w = s.writer()
    _writer_step(w, run, 1)
    w.flush()
    _writer_step(w, run, 2)
    w.add_feedback([{"attempt_id": "no-such-attempt", "kind": "x"}])  # FK violation at commit
    with pytest.raises(TraceWriteError) as info:
        w.flush()
    assert isinstance(info.value.__cause__, IntegrityError)
    with pytest.raises(TraceWriteError):
        w.submit(lambda session: None)  # the writer stays failed: nothing is silently dropped
    with pytest.raises(TraceWriteError):
        w.close()
    assert [st["step"] for st in s.steps(run)] == [1]
    assert s.export_jsonl(run, io.StringIO()) == 2
    s.close()


def test_writer_context_manager_drops_a_step_interrupted_by_an_exception(db_url):
    s = TraceStore(db_url)
    run = s.create_run("w")
    with pytest.raises(RuntimeError, match="boom"), s.writer() as w:
        _writer_step(w, run, 1)
        w.end_step()
        _writer_step(w, run, 2)
        raise RuntimeError("boom")
    assert [st["step"] for st in s.steps(run)] == [1]
    with s.writer() as w:  # a clean exit commits what is pending
        _writer_step(w, run, 2)
    assert [st["step"] for st in s.steps(run)] == [1, 2]
    s.close()


CHILD = textwrap.dedent(
    """
    import sys, time
    from selfdistill.store import TraceStore

    store = TraceStore(sys.argv[1])
    run = sys.argv[2]
    w = store.writer()

    def step(k):
        ids = w.add_attempts(run, [dict(prompt=[], completion=f"{k}.{i}", completion_ids=[k],
                                        step=k) for i in range(3)])
        w.add_feedback([dict(attempt_id=a, kind="test_failure", text=str(k)) for a in ids])
        w.record_step(run, k, ids, loss=float(k))

    step(1); w.flush(timeout=30); print("flushed 1", flush=True)
    step(2); w.end_step(); print("ended 2", flush=True)  # in flight: committed or not
    step(3); print("building 3", flush=True)  # never handed over
    time.sleep(60)
    """
)


def test_writer_sigkill_loses_at_most_the_in_flight_step(db_url, tmp_path):
    s = TraceStore(db_url)
    run = s.create_run("crash")
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, str(script), db_url, run],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip
    try:
        lines = [proc.stdout.readline().strip() for _ in range(3)]
        assert lines == ["flushed 1", "ended 2", "building 3"], proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    fresh = TraceStore(db_url)
    steps = fresh.steps(run)
    assert [st["step"] for st in steps][:1] == [1]
    assert {st["step"] for st in steps} <= {1, 2}  # step 3 was never handed over
    rows = [json.loads(line) for line in _export(fresh, run).splitlines()]
    # each committed step is whole: 3 attempts, each with its feedback; nothing else survived
    assert len(rows) == 3 * len(steps)
    assert all(len(r["feedback"]) == 1 and len(r["consumed_by"]) == 1 for r in rows)
    fresh.close()
    s.close()


def _export(store, run) -> str:
    buf = io.StringIO()
    store.export_jsonl(run, buf)
    return buf.getvalue()


# -- CLI and helpers --------------------------------------------------------------------------


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="selfdistill")
    add_subcommand(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli_export_from_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "run-a"
    s = TraceStore(path=run_dir)
    run, ids0, ids1, *_ = _write_run(s)
    s.close()
    out = tmp_path / "out.jsonl"
    assert _cli("traces", "export", str(run_dir), "--format", "jsonl", "--out", str(out)) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == [*ids0, *ids1]
    assert "exported 4 attempts" in capsys.readouterr().err

    assert _cli("traces", "export", str(run_dir)) == 0  # to standard output
    assert capsys.readouterr().out == out.read_text()

    with pytest.raises(UserError, match="not a run directory"):
        _cli("traces", "export", str(tmp_path / "missing"))
    with pytest.raises(UserError, match="no trace store"):
        _cli("traces", "export", run, "--store", str(tmp_path / "typo.db"))
    assert not (tmp_path / "typo.db").exists()


def test_cli_export_by_run_id_with_store_url(db_url, tmp_path):
    s = TraceStore(db_url)
    run, *_ = _write_run(s)
    s.create_run("another")  # with two runs, the id picks one
    s.close()
    out = tmp_path / "x.jsonl"
    assert _cli("traces", "export", run, "--store", db_url, "--out", str(out)) == 0
    assert len(out.read_text().splitlines()) == 4
    assert _cli("traces", "export", "sdpo-demo", "--store", db_url, "--out", str(out)) == 0
    with pytest.raises(UserError, match="no run"):
        _cli("traces", "export", "nope", "--store", db_url)


def test_ids_sort_by_creation_and_token_credit_summary():
    ids = [new_id() for _ in range(2000)]
    assert ids == sorted(ids) and len(set(ids)) == len(ids)
    assert all(len(i) == 32 for i in ids)
    summary = summarize_token_credit([0.5, -2.0, 0.25, 1.0], top=2)
    assert summary == {"n": 4, "mean": -0.0625, "min": -2.0, "max": 1.0,
                       "top": [[1, -2.0], [3, 1.0]]}  # fmt: skip
    assert summarize_token_credit([])["n"] == 0
