"""The trace & lineage store: every arrow of the loop (attempt → feedback → teacher context →
training step → checkpoint) as rows with stable ids, so an adapter can be traced back to the
evidence that shaped it and any training batch replayed.

    store = TraceStore(path=run_dir)              # run_dir/traces.db (SQLite, WAL)
    run_id = store.create_run("demo", scope="user:alice", config=cfg)
    with store.writer() as w:                     # background thread, one commit per step
        ids = w.add_attempts(run_id, [...]); w.add_feedback([...]); ...
        w.record_step(run_id, step, ids, loss=loss, checkpoint_before=ckpt)
        w.end_step()
    store.step_batch(run_id, step)                # everything to rebuild that batch

Modules: `models` (tables), `records` (validated write plans), `store` (`TraceStore`),
`writer` (`TraceWriter`), `migrations` (Alembic, run on open), `cli` (`selfdistill traces`),
`registry_models` (the adapter registry's tables, used by `selfdistill.registry`),
`serve_models` (the server's tables, used by `selfdistill.serve` and `selfdistill.governance`).
"""

from selfdistill.store import registry_models, serve_models  # noqa: F401  (tables join Base.metadata)
from selfdistill.store.models import CREDIT_SCOPES, new_id
from selfdistill.store.records import sha256_file, summarize_token_credit
from selfdistill.store.store import DB_FILENAME, TraceStore
from selfdistill.store.writer import TraceWriteError, TraceWriter

__all__ = [
    "CREDIT_SCOPES",
    "DB_FILENAME",
    "TraceStore",
    "TraceWriteError",
    "TraceWriter",
    "new_id",
    "sha256_file",
    "summarize_token_credit",
]
