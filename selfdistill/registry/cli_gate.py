"""The gate options of ``selfdistill adapters promote``: a spec file and flags over the version's
default gate (`selfdistill.registry.gate.default_spec`)."""

from __future__ import annotations

import argparse

from selfdistill.errors import UserError
from selfdistill.registry.gate import BUILTIN, GateSpec, TaskSuite, load_spec


def add_gate_args(p: argparse.ArgumentParser) -> None:
    """Add the gate options to a ``promote`` parser."""
    g = p.add_argument_group("gate (default: what the version's training config implies)")
    g.add_argument("--gate", metavar="FILE", help="gate spec, YAML or JSON (GateSpec fields)")
    g.add_argument(
        "--task-data",
        metavar="NAME=PATH",
        action="append",
        default=[],
        help="task suite (repeatable); replaces the default suites; must improve",
    )
    g.add_argument(
        "--task-tolerance",
        type=float,
        metavar="T",
        default=None,
        help="instead: every task suite may lose at most T accuracy (fraction)",
    )
    g.add_argument(
        "--probe-data",
        metavar="PATH",
        action="append",
        default=[],
        help="extra forgetting probes JSONL (repeatable)",
    )
    g.add_argument(
        "--no-builtin-probes", action="store_true", help="leave out the packaged forgetting probes"
    )
    g.add_argument(
        "--probe-tolerance",
        type=int,
        metavar="N",
        default=None,
        help="forgetting probes that may be lost",
    )
    g.add_argument(
        "--check",
        metavar="MODULE:FUNCTION",
        action="append",
        default=[],
        help="custom check called with (model, tokenizer) (repeatable)",
    )
    g.add_argument(
        "--eval-max-new-tokens",
        type=int,
        metavar="N",
        default=None,
        help="greedy answer budget of the gate's evaluations",
    )


def gate_spec(spec: GateSpec, args: argparse.Namespace) -> GateSpec:
    """`spec` (the version's default gate) overridden by ``--gate FILE``, then by the flags."""
    if args.gate:
        spec = load_spec(args.gate, spec)
    tree = spec.model_dump()
    if args.task_data:
        tree["tasks"] = {}
        for item in args.task_data:
            name, sep, path = item.partition("=")
            if not (sep and name and path):
                raise UserError(f"--task-data {item!r}: expected NAME=PATH")
            tree["tasks"][name] = TaskSuite(path=path).model_dump()
    if args.task_tolerance is not None:
        for suite in tree["tasks"].values():
            suite.update(must="not_regress", tolerance=args.task_tolerance)
    probes = [p for p in tree["probes"] if not (args.no_builtin_probes and p == BUILTIN)]
    tree["probes"] = list(dict.fromkeys(probes + args.probe_data))  # one file counts once
    tree["checks"] = tree["checks"] + args.check
    if args.probe_tolerance is not None:
        tree["probe_tolerance"] = args.probe_tolerance
    if args.eval_max_new_tokens is not None:
        tree["max_new_tokens"] = args.eval_max_new_tokens
    try:
        return GateSpec.model_validate(tree)
    except ValueError as exc:
        raise UserError(f"gate options: {exc}") from None
