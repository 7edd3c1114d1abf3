"""`RegistryBase`: where the registry lives (database + weights directory), sessions, and the
per-scope write lock that every change of a scope takes (see `selfdistill.registry.lifecycle`)."""

from __future__ import annotations

import getpass
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Self

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from selfdistill.registry import queries
from selfdistill.registry.weights import WeightStore
from selfdistill.store import TraceStore
from selfdistill.store.models import utcnow
from selfdistill.store.registry_models import AdapterScope, AdapterVersion

REGISTRY_FILENAME = "registry.db"


def default_location() -> Path:
    """``$SELFDISTILL_HOME/registry.db``, else ``./.selfdistill/registry.db``."""
    home = os.environ.get("SELFDISTILL_HOME")
    return (Path(home) if home else Path.cwd() / ".selfdistill") / REGISTRY_FILENAME


class RegistryBase:
    """``Registry()`` opens the default SQLite file; ``Registry("path/registry.db")``, a directory
    (``DIR/registry.db``) or a database URL open another. Weights live under `weights_dir`
    (default: ``adapters/`` beside a SQLite file, else beside `default_location()`). `actor`
    is who changes are recorded as (default: ``$SELFDISTILL_ACTOR``, else the login name)."""

    def __init__(
        self,
        location: str | Path | None = None,
        *,
        weights_dir: str | Path | None = None,
        actor: str | None = None,
    ) -> None:
        loc = str(location) if location is not None else str(default_location())
        if "://" in loc:
            self.store = TraceStore(loc)
        else:
            path = Path(loc).expanduser()
            if path.is_dir() or (not path.exists() and not path.suffix):
                path = path / REGISTRY_FILENAME
            self.store = TraceStore(path=path)
        db = self.store.url.database if self.store.url.get_backend_name() == "sqlite" else None
        home = Path(db).resolve().parent if db and db != ":memory:" else default_location().parent
        self.weights = WeightStore(weights_dir if weights_dir is not None else home / "adapters")
        self.actor = actor or os.environ.get("SELFDISTILL_ACTOR") or _login()

    def __repr__(self) -> str:
        return f"Registry({self.store.url.render_as_string(hide_password=True)!r})"

    def close(self) -> None:
        """Close the database connections."""
        self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def session(self) -> Session:
        """A plain read session."""
        return self.store.session()

    # -- locking ----------------------------------------------------------------------------

    def _ensure_scope(self, scope: str) -> None:
        try:
            with self.store.session() as s, s.begin():
                if s.get(AdapterScope, scope) is None:
                    s.add(AdapterScope(name=scope, updated_at=utcnow()))
        except IntegrityError:
            pass  # created by a concurrent writer: just as good

    @contextmanager
    def _locked(self, scope: str) -> Iterator[tuple[Session, AdapterScope]]:
        """A transaction holding `scope`'s row lock; commits on normal exit."""
        self._ensure_scope(scope)
        with self.store.engine.connect() as conn:
            conn.execution_options(sqlite_begin="IMMEDIATE")
            with Session(bind=conn, expire_on_commit=False) as s, s.begin():
                stmt = select(AdapterScope).where(AdapterScope.name == scope).with_for_update()
                yield s, s.scalars(stmt).one()

    def ref(self, ref: str) -> str:
        """The full id of the version that `ref` (an id or a unique prefix of ≥ 4) names."""
        with self.session() as s:
            return queries.resolve_ref(s, ref)

    def _version(self, s: Session, ref: str) -> AdapterVersion:
        return s.get_one(AdapterVersion, queries.resolve_ref(s, ref))

    def _weights(self, v: AdapterVersion) -> Path:
        """Where `v`'s files are (`queries.weights_dir`); UserError if they are gone."""
        return queries.weights_dir(v, self.weights.path(v.id))


def _login() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (containers)
        return "unknown"
