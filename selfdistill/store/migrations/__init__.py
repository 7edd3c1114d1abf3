"""Alembic migrations of the trace store, run programmatically: no alembic.ini is needed.

`upgrade(engine)` brings a database to the newest revision; `TraceStore` calls it on open. To
write a new revision after changing `selfdistill/store/models.py`::

    from alembic import command
    from selfdistill.store.migrations import alembic_config
    command.revision(alembic_config("sqlite:////tmp/scratch.db"), "what changed", autogenerate=True)

(the scratch database must be at the previous head first: ``TraceStore(path="/tmp/scratch.db")``).
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection, Engine

from selfdistill.errors import UserError

MIGRATIONS_DIR = Path(__file__).resolve().parent

# Any fixed 64-bit number: serializes concurrent `upgrade` calls on one PostgreSQL database.
_PG_LOCK_KEY = 0x5E1FD157111


def alembic_config(url: str | None = None) -> Config:
    """An Alembic `Config` whose scripts are this package directory (works when installed)."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))  # ConfigParser escaping
    return cfg


def head_revision() -> str:
    """The newest revision id shipped with this version of selfdistill."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None, "no migration scripts found"
    return head


def current_revision(conn: Connection) -> str | None:
    """The revision the database is at (None for an empty database)."""
    return MigrationContext.configure(conn).get_current_revision()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Migrate the database behind `engine` to `revision`, from empty if need be (one transaction
    where the backend has transactional DDL)."""
    cfg = alembic_config()
    scripts = ScriptDirectory.from_config(cfg)
    with engine.connect() as conn, conn.execution_options(sqlite_begin="IMMEDIATE").begin():
        if conn.dialect.name == "postgresql":
            # Two processes opening the same new database must not both create the tables.
            conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({_PG_LOCK_KEY})")
        current = current_revision(conn)
        if current is not None and current not in {s.revision for s in scripts.walk_revisions()}:
            raise UserError(
                f"the trace store {engine.url.render_as_string(hide_password=True)} is at schema "
                f"revision {current}, which this selfdistill does not know: it was written by a "
                "newer version; upgrade selfdistill"
            )
        if revision == "head" and current == scripts.get_current_head():
            return  # the common case: nothing to do, and no Alembic environment to load
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)
