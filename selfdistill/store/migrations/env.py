"""Alembic environment: migrates the connection handed over in `config.attributes`, or builds
one from ``sqlalchemy.url`` (see `selfdistill.store.migrations.alembic_config`)."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from selfdistill.store.models import Base

config = context.config
target_metadata = Base.metadata


def _configure(**kwargs: object) -> None:
    # render_as_batch: SQLite can only change a table by copying it; batch mode does that.
    context.configure(target_metadata=target_metadata, render_as_batch=True, **kwargs)


def run_offline() -> None:
    """Emit SQL for ``sqlalchemy.url``'s dialect instead of running it."""
    _configure(url=config.get_main_option("sqlalchemy.url"), literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    """Run the migrations on a live connection."""
    conn = config.attributes.get("connection")
    if conn is not None:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.begin() as conn:
        _configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
