"""`Registry`: the adapter registry's Python API (used by `selfdistill adapters` and the server):
`Lifecycle`'s changes plus the reads, resolution at inference and loading an adapter."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select

from selfdistill.registry import queries
from selfdistill.registry.lifecycle import Lifecycle
from selfdistill.store.records import check_scope
from selfdistill.store.registry_models import AdapterScope, AdapterVersion


@dataclass
class Resolution:
    """Which adapter serves a request: `version` of `scope`, or the base model (both None).
    `order` lists the scopes tried, first match wins."""

    scope: str | None
    version: str | None
    order: list[str]

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready; what generation metadata carries."""
        return asdict(self)


class Registry(Lifecycle):
    """The registry. ``Registry()`` opens the default SQLite file (`default_location`);
    ``Registry(PATH_OR_URL, weights_dir=..., actor=...)`` another (see `RegistryBase`)."""

    def resolve(self, user: str | None = None, workspace: str | None = None) -> Resolution:
        """The adapter for a request: the user's active version, else the workspace's, else the
        global one, else the base model."""
        order = [
            check_scope(f"{kind}:{name}" if ":" not in name else name)
            for kind, name in (("user", user), ("workspace", workspace))
            if name
        ]
        order.append("global")
        with self.session() as s:
            active = {
                name: vid
                for name, vid in s.execute(
                    select(AdapterScope.name, AdapterScope.active_version_id).where(
                        AdapterScope.name.in_(order)
                    )
                )
            }
        for name in order:
            if active.get(name):
                return Resolution(name, active[name], order)
        return Resolution(None, None, order)

    def load(self, model: Any, version: str | None) -> Any:
        """`model` with `version`'s adapter applied (PEFT injects it into `model` in place: pass
        a fresh copy to keep the plain one); None = `model` itself (the base)."""
        if version is None:
            return model
        from selfdistill.models import load_adapter

        with self.session() as s:
            return load_adapter(model, self._weights(self._version(s, version)))

    def weights_path(self, version: str) -> Path:
        """The directory holding `version`'s adapter files (UserError if gc removed them)."""
        with self.session() as s:
            return self._weights(self._version(s, version))

    def load_resolved(
        self,
        user: str | None = None,
        workspace: str | None = None,
        *,
        model: str | None = None,
        progress: bool = False,
    ) -> tuple[Any, Resolution]:
        """(`LoadedModel` with the resolved adapter, `Resolution`). The base is the version's
        own base model; `model` (default: the embedded one) when the base model serves."""
        from selfdistill.models import load_model

        res = self.resolve(user, workspace)
        if res.version is None:
            return load_model(model, progress=progress), res
        with self.session() as s:
            v = s.get_one(AdapterVersion, res.version)
            lm = load_model(queries.base_ref(v), progress=progress)
            lm.model = self.load(lm.model, v.id)
        return lm, res

    def list(self, scope: str | None = None) -> list[dict[str, Any]]:
        """Versions (of `scope`), oldest first, each with ``active_in`` and its last gate run."""
        with self.session() as s:
            return queries.list_versions(s, None if scope is None else check_scope(scope))

    def show(self, version: str) -> dict[str, Any]:
        """One version with its gate runs and the activations that involve it."""
        with self.session() as s:
            return queries.show(s, self._version(s, version))

    def history(self, scope: str) -> list[dict[str, Any]]:
        """A scope's activations, oldest first."""
        with self.session() as s:
            return [a.as_dict() for a in queries.history_rows(s, check_scope(scope))]

    def scopes(self) -> list[dict[str, Any]]:
        """Every scope with its active version, quota and bytes used."""
        with self.session() as s:
            return queries.scopes(s)

    def lineage(self, version: str) -> list[dict[str, Any]]:
        """The ancestry chain, `version` first, each with its data ids and gate results."""
        with self.session() as s:
            return queries.lineage(s, self._version(s, version))

    def diff(self, a: str, b: str) -> dict[str, Any]:
        """Two versions' training metrics and latest gate results side by side."""
        with self.session() as s:
            return queries.diff(s, self._version(s, a), self._version(s, b))
