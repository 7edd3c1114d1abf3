"""`Service`: everything a request needs — the config, the engine, the registry (which also holds
the server's tables), the tenant of a request, and which adapter serves it.

Tenants: the request's `user` field is the scope ``user:<user>``; the ``X-Selfdistill-Scope``
header names a workspace (``acme`` or ``workspace:acme``). Resolution is the registry's: user →
workspace → global → base. A request learns into its most specific scope (the user's, else the
workspace's); a request with neither is served but never learned from, and no request ever
learns into `global` (promotion there is an operator's gated act).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from selfdistill.chat import Message, prompt_ids
from selfdistill.errors import UserError
from selfdistill.registry import Registry
from selfdistill.serve import state
from selfdistill.serve.config import ServeConfig
from selfdistill.serve.engine import Engine
from selfdistill.serve.protocol import APIError
from selfdistill.store.records import check_scope

SCOPE_HEADER = "x-selfdistill-scope"


@dataclass
class Tenant:
    """Who a request is: the user and workspace ids as the registry resolves them, and the scope
    it learns into (None: nobody's)."""

    user: str | None
    workspace: str | None

    @property
    def scope(self) -> str | None:
        """The scope feedback teaches: the user's, else the workspace's."""
        if self.user:
            return f"user:{self.user}"
        return self.workspace


@dataclass
class Route:
    """Which weights serve a request: `adapter` (an engine adapter name; None = base) and the
    metadata every response carries."""

    adapter: str | None
    meta: dict[str, Any]

    @property
    def version(self) -> str | None:
        """The registry version, None for the base model or a runtime-loaded LoRA."""
        return self.meta.get("version")


class Service:
    """Shared by the app's routes and the learner."""

    def __init__(self, cfg: ServeConfig, engine: Engine, registry: Registry) -> None:
        self.cfg, self.engine, self.registry = cfg, engine, registry
        self.model_name = cfg.served_model_name or engine.name
        self.aliases = {self.model_name, "default", engine.name}
        self.loras: dict[str, str] = {}  # lora_name → engine adapter name
        self.learner: Any = None
        self.sessions = registry.store.session
        self.load_lock = threading.Lock()
        for scope, consent in cfg.governance.consent.items():
            self.set_flags(check_scope(scope), consent=consent)

    # -- tenants ---------------------------------------------------------------------------------

    def tenant(self, user: str | None, header: str | None) -> Tenant:
        """The tenant of a request (APIError 400 for a malformed scope header)."""
        workspace = None
        if header:
            workspace = header if ":" in header else f"workspace:{header}"
            if workspace == "global" or workspace.startswith("user:"):
                raise APIError(
                    400,
                    f"{SCOPE_HEADER} {header!r}: name a workspace (acme or workspace:acme); "
                    "the user is the request's `user` field",
                    param=SCOPE_HEADER,
                )
            try:
                check_scope(workspace)
            except UserError as exc:
                raise APIError(400, f"{SCOPE_HEADER}: {exc}", param=SCOPE_HEADER) from None
        if user is not None and (not user.strip() or any(c.isspace() for c in user)):
            raise APIError(400, "user must be a non-empty id without spaces", param="user")
        return Tenant(user or None, workspace)

    def flags(self, scope: str) -> dict[str, Any]:
        """{scope, consent, paused} of a tenant."""
        return state.tenant(self.sessions, scope, self.cfg.governance.consent_default)

    def set_flags(self, scope: str, **flags: bool) -> dict[str, Any]:
        """Set a tenant's consent / paused flags."""
        return state.set_flags(self.sessions, scope, self.cfg.governance.consent_default, **flags)

    def learns(self, tenant: Tenant) -> bool:
        """Whether this tenant's conversations may be stored for training (consent)."""
        return tenant.scope is not None and bool(self.flags(tenant.scope)["consent"])

    def delete_tenant(self, scope: str) -> dict[str, Any]:
        """Delete everything of `scope` (`selfdistill.governance.deletion`), after the learner's
        current pass; its adapters stop serving (requests running on them finish first)."""
        from selfdistill.governance.deletion import delete_tenant
        from selfdistill.serve.learner import scope_dir

        versions = [v["id"] for v in self.registry.list(scope)]
        with self.learner.busy:
            proof = delete_tenant(self.registry, scope, self.learner.runs_dir / scope_dir(scope),
                                  actor="admin")
        for v in versions:
            if self.engine.has(v):
                self.engine.unload(v)
        return proof

    # -- routing ---------------------------------------------------------------------------------

    def route(self, model: str, tenant: Tenant | None = None) -> Route:
        """The adapter for `model`: the served model → the tenant's resolution in the registry;
        a loaded LoRA's name → that LoRA. APIError 404 for any other name."""
        if model in self.loras:
            return Route(self.loras[model], {"lora": model, "scope": None, "version": None})
        if model not in self.aliases:
            raise APIError(
                404,
                f"The model `{model}` does not exist; available: "
                f"{', '.join([self.model_name, *self.loras])}",
                param="model",
                code="model_not_found",
            )
        tenant = tenant or Tenant(None, None)
        res = self.registry.resolve(user=tenant.user, workspace=tenant.workspace)
        if res.version is not None:
            self.ensure_version(res.version)
        return Route(res.version, res.as_dict())

    def ensure_version(self, version: str) -> None:
        """Load a registry version's adapter into the engine (once)."""
        if self.engine.has(version):
            return
        with self.load_lock:
            self.engine.load(version, self.registry.weights_path(version))

    def prompt(self, messages: list[Message]) -> list[int]:
        """Token ids of `messages` under the chat template, length-checked."""
        ids = prompt_ids(self.engine.tokenizer, messages)
        self.check_prompt(ids, "messages")
        return ids

    def check_prompt(self, ids: list[int], param: str) -> None:
        """APIError 400 for an empty prompt, one over the limit or out-of-vocabulary ids."""
        limit = self.cfg.limits.max_prompt_tokens
        if not ids:
            raise APIError(400, f"{param}: the prompt is empty", param=param)
        if len(ids) > limit:
            raise APIError(
                400,
                f"{param}: the prompt has {len(ids)} tokens; the limit is {limit}",
                param=param,
                code="context_length_exceeded",
            )
        vocab = self.engine.model.get_input_embeddings().num_embeddings
        if min(ids) < 0 or max(ids) >= vocab:
            raise APIError(400, f"{param}: token ids must be in [0, {vocab})", param=param)

    def max_tokens(self, asked: int | None) -> int:
        """The request's budget: `asked` or the default, at most the limit (400 beyond)."""
        lim = self.cfg.limits
        if asked is None:
            return lim.default_max_tokens
        if asked > lim.max_tokens:
            raise APIError(
                400, f"max_tokens {asked} exceeds the limit {lim.max_tokens}", param="max_tokens"
            )
        return asked
