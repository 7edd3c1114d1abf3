"""``selfdistill adapters ...``: the adapter registry from the command line (see docs/registry.md).

Every sub-command takes ``--registry URL_OR_PATH`` (default: `default_location()`),
``--weights-dir DIR`` and ``--json``. VERSION is an id or a unique prefix of ≥ 4 characters.
Exit codes: 0 done; 1 the gate rejected a promotion; 2 bad input (one line saying why).
"""

from __future__ import annotations

import argparse
import re
from typing import Any

from selfdistill.errors import UserError
from selfdistill.registry.cli_gate import add_gate_args, gate_spec

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_bytes(text: str) -> int:
    """``5000``, ``20MB`` (10^6), ``1.5GiB`` (2^30) → bytes."""
    m = _SIZE.match(text)
    if not m:
        raise UserError(f"--bytes {text!r}: expected a size such as 5000, 20MB or 1GiB")
    unit = (m.group(2) or "").lower().removesuffix("b")
    return int(float(m.group(1)) * _UNITS[unit])


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--registry",
        metavar="URL_OR_PATH",
        default=None,
        help="registry database: a SQLite file or directory, or a database URL "
        "(default: $SELFDISTILL_HOME/registry.db, else ./.selfdistill/registry.db)",
    )
    p.add_argument(
        "--weights-dir",
        metavar="DIR",
        default=None,
        help="where version weights live (default: adapters/ beside the database)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--quiet", action="store_true", default=argparse.SUPPRESS, help="no progress bars"
    )


def add_subcommand(subparsers: Any) -> None:
    """Register ``adapters`` on the main parser's `add_subparsers()` object."""
    top = subparsers.add_parser("adapters", help="adapter registry: propose, promote, rollback")
    sub = top.add_subparsers(dest="adapters_command", required=True, metavar="ACTION")

    def action(name: str, help: str, func: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        _common(p)
        p.set_defaults(func=func)
        return p

    p = action("propose", "register a training run's adapter as a version", _propose)
    p.add_argument("run_dir", metavar="RUN_DIR", help="output_dir of selfdistill train")
    p.add_argument("--scope", help="global, workspace:<id> or user:<id> (default: the run's)")
    p.add_argument("--parent", metavar="VERSION", help="default: the scope's active version")
    p = action("list", "list versions", _list)
    p.add_argument("--scope")
    p = action("show", "one version: lineage record, gate runs, activations", _show)
    p.add_argument("version", metavar="VERSION")
    p = action("lineage", "ancestry chain with data ids and gate results", _lineage)
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--mermaid", action="store_true", help="print a mermaid flowchart")
    p = action("promote", "gate a version, then make it its scope's active one", _promote)
    p.add_argument("version", metavar="VERSION")
    p.add_argument("--scope", help="must be the version's own scope (the default)")
    p.add_argument("--force", action="store_true", help="skip the gate (recorded as forced)")
    p.add_argument("--reason", help="why (recorded)")
    p.add_argument("--actor", help="who (recorded; default $SELFDISTILL_ACTOR or the login)")
    add_gate_args(p)
    p = action("rollback", "re-activate the previous (or a named) version", _rollback)
    p.add_argument("--scope", default="global")
    p.add_argument("--to", metavar="VERSION", help="a version once active there, or 'base'")
    p.add_argument("--reason")
    p.add_argument("--actor")
    p = action("diff", "two versions' metrics and gate results side by side", _diff)
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p = action("gc", "remove weights of never-activated versions and orphaned files", _gc)
    p.add_argument(
        "--grace",
        type=float,
        default=3600.0,
        metavar="SECONDS",
        help="spare anything younger (a proposal may be in flight)",
    )
    p.add_argument("--dry-run", action="store_true")
    p = action(
        "resolve", "which adapter serves a request (user → workspace → global → base)", _resolve
    )
    p.add_argument("--user")
    p.add_argument("--workspace")
    p = action("history", "a scope's activations, oldest first", _history)
    p.add_argument("--scope", default="global")
    p = action("scopes", "scopes with their active version, quota and bytes used", _scopes)
    p = action("quota", "set a scope's storage quota", _quota)
    p.add_argument("--scope", required=True)
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--bytes", help="e.g. 500MB, 2GiB")
    group.add_argument("--unlimited", action="store_true")


def _open(args: argparse.Namespace) -> Any:
    from selfdistill.registry import Registry

    return Registry(args.registry, weights_dir=args.weights_dir)


def _out(args: argparse.Namespace, obj: Any, text: str) -> None:
    from selfdistill.cli import print_json

    if args.json:
        print_json(obj)
    else:
        print(text)


def _propose(args: argparse.Namespace) -> int:
    with _open(args) as reg:
        v = reg.propose(args.run_dir, scope=args.scope, parent=args.parent)
    word = "registered" if v["created"] else "already registered"
    _out(
        args,
        v,
        f"{word} {v['id']} for {v['scope']} ({v['size_bytes']} bytes, "
        f"{len(v['data_ids'])} data ids); promote: selfdistill adapters promote "
        f"{v['short']}",
    )
    return 0


def _list(args: argparse.Namespace) -> int:
    from selfdistill.registry.views import versions_table

    with _open(args) as reg:
        rows = reg.list(args.scope)
    _out(args, rows, versions_table(rows))
    return 0


def _show(args: argparse.Namespace) -> int:
    import json

    with _open(args) as reg:
        v = reg.show(args.version)
    _out(args, v, json.dumps(v, indent=2, ensure_ascii=False, default=str))
    return 0


def _lineage(args: argparse.Namespace) -> int:
    from selfdistill.registry.views import lineage_mermaid, lineage_text

    with _open(args) as reg:
        chain = reg.lineage(args.version)
    text = lineage_mermaid(chain) if args.mermaid else lineage_text(chain)
    _out(args, {"chain": chain, "mermaid": lineage_mermaid(chain)} if args.json else chain, text)
    return 0


def _promote(args: argparse.Namespace) -> int:
    with _open(args) as reg:
        spec = None if args.force else gate_spec(reg.default_gate(args.version), args)
        res = reg.promote(
            args.version,
            args.scope,
            force=args.force,
            actor=args.actor,
            reason=args.reason,
            gate=spec,
            progress=not args.quiet,
        )
    gate = res["gate"]
    lines = [
        f"  {'✓' if c['passed'] else '✗'} {c['name']}: {c['before']:g} → {c['after']:g} "
        f"({c['rule']})"
        for c in (gate["verdict"]["checks"] if gate else [])
    ]
    if res["promoted"]:
        how = "forced (gate skipped)" if res["forced"] else gate["verdict"]["summary"]
        head = (
            f"{res['version'][:12]} is now active in {res['scope']} (was "
            f"{(res['previous'] or 'base')[:12]}); {how}"
        )
    else:
        head = (
            f"gate rejected {res['version'][:12]} for {res['scope']}: "
            f"{gate['verdict']['summary']}; active version unchanged"
        )
    _out(args, res, "\n".join([head, *lines]))
    return 0 if res["promoted"] else 1


def _rollback(args: argparse.Namespace) -> int:
    with _open(args) as reg:
        res = reg.rollback(args.scope, args.to, actor=args.actor, reason=args.reason)
    _out(
        args,
        res,
        f"{res['scope']}: rolled back from {(res['previous'] or 'base')[:12]} to "
        f"{(res['version'] or 'base')[:12]}",
    )
    return 0


def _diff(args: argparse.Namespace) -> int:
    from selfdistill.registry.views import diff_text

    with _open(args) as reg:
        d = reg.diff(args.a, args.b)
    _out(args, d, diff_text(d))
    return 0


def _gc(args: argparse.Namespace) -> int:
    with _open(args) as reg:
        res = reg.gc(grace_s=args.grace, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    _out(
        args,
        res,
        f"{verb} the weights of {len(res['versions'])} version(s), "
        f"{len(res['orphans'])} orphaned and {len(res['stale'])} stale "
        f"director(ies); {res['freed_bytes']} bytes freed",
    )
    return 0


def _resolve(args: argparse.Namespace) -> int:
    with _open(args) as reg:
        res = reg.resolve(user=args.user, workspace=args.workspace).as_dict()
    text = (
        f"{res['version']} (active in {res['scope']})"
        if res["version"]
        else f"base model (no active version in {', '.join(res['order'])})"
    )
    _out(args, res, text)
    return 0


def _history(args: argparse.Namespace) -> int:
    with _open(args) as reg:
        rows = reg.history(args.scope)
    text = "\n".join(
        f"{a['seq']:>3} {a['created_at'][:19]} {a['action']:<8} "
        f"{(a['from_version_id'] or 'base')[:12]} → {(a['to_version_id'] or 'base')[:12]} "
        f"by {a['actor']}" + (f": {a['reason']}" if a["reason"] else "")
        for a in rows
    )
    _out(args, rows, text or f"{args.scope}: no activations yet")
    return 0


def _scopes(args: argparse.Namespace) -> int:
    with _open(args) as reg:
        rows = reg.scopes()
    text = "\n".join(
        f"{r['name']:<24} active {(r['active_version_id'] or 'base')[:12]:<12} "
        f"used {r['used_bytes']} of {r['quota_bytes'] or 'unlimited'} bytes"
        for r in rows
    )
    _out(args, rows, text or "no scopes yet")
    return 0


def _quota(args: argparse.Namespace) -> int:
    quota = None if args.unlimited else parse_bytes(args.bytes)
    with _open(args) as reg:
        reg.set_quota(args.scope, quota)
    _out(
        args,
        {"scope": args.scope, "quota_bytes": quota},
        f"{args.scope}: quota {quota if quota is not None else 'unlimited'} bytes",
    )
    return 0
