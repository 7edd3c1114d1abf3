"""`selfdistill serve [CONFIG.yaml] [key=value ...]` and `selfdistill tenants delete SCOPE`."""

from __future__ import annotations

import argparse

from selfdistill.errors import UserError


def _cmd_serve(args: argparse.Namespace) -> int:
    from selfdistill.serve.config import help_text, load_serve_config
    from selfdistill.serve.server import serve

    if args.help_config:
        print(help_text())
        return 0
    config, overrides = args.config, list(args.overrides)
    if config is not None and "=" in config:  # no file, only overrides
        config, overrides = None, [config, *overrides]
    serve(load_serve_config(config, overrides))
    return 0


def _cmd_tenants(args: argparse.Namespace) -> int:
    from selfdistill.cli import print_json
    from selfdistill.governance.deletion import delete_tenant
    from selfdistill.registry import Registry
    from selfdistill.serve import state
    from selfdistill.serve.config import load_serve_config
    from selfdistill.serve.learner import scope_dir
    from selfdistill.store.records import check_scope

    if args.action == "delete" and not args.scope:
        raise UserError("tenants delete: name the tenant, e.g. `selfdistill tenants delete "
                        "user:alice`")
    cfg = load_serve_config(args.config, list(args.set or []))
    home = cfg.home_dir()
    with Registry(cfg.registry or home / "registry.db",
                  weights_dir=None if cfg.registry else home / "adapters") as reg:
        if args.action == "list":
            print_json(state.tenants(reg.store.session))
            return 0
        scope = check_scope(args.scope)
        proof = delete_tenant(reg, scope, home / "runs" / scope_dir(scope), actor="cli")
    print_json(proof)
    return 0 if proof["deleted"] else 1


def add_subcommand(sub: argparse._SubParsersAction) -> None:
    """Register `serve` and `tenants`."""
    p = sub.add_parser("serve", help="OpenAI-compatible server that learns from its users "
                       "(docs/serving.md)")
    p.add_argument("config", nargs="?", default=None, help="serve config YAML (optional)")
    p.add_argument("overrides", nargs="*", help="key=value overrides, e.g. port=8000 "
                   "learner.every_lessons=2")
    p.add_argument("--help-config", action="store_true", help="list every config key")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("tenants", help="the server's tenants: list, delete (with proof)")
    p.add_argument("action", choices=["list", "delete"])
    p.add_argument("scope", nargs="?", help="delete: the tenant scope, e.g. user:alice")
    p.add_argument("--config", default=None, help="the server's config YAML")
    p.add_argument("--set", action="append", help="config override key=value (repeatable)")
    p.set_defaults(func=_cmd_tenants)
