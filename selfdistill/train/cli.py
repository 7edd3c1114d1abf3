"""`selfdistill train CONFIG.yaml [key=value ...]` and `selfdistill train --resume RUN_DIR`."""

from __future__ import annotations

import argparse
from pathlib import Path

from selfdistill.errors import UserError


def _print_summary(summary: dict) -> None:
    print(f"\n{'suite':<14}{'n':>4}{'before':>9}{'after':>9}{'oracle':>9}")
    for name, a in summary["after"].items():
        b = summary["before"].get(name, {}).get("accuracy")
        o = summary["oracle"].get(name, {}).get("accuracy")
        fmt = lambda x: "—" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        print(f"{name:<14}{a['n']:>4}{fmt(b):>9}{fmt(a['accuracy']):>9}{fmt(o):>9}")
    print(f"\ngate verdict: {summary['gate']['summary']}")
    print(f"adapter: {summary['adapter']}")
    print(f"report:  {Path(summary['adapter']).parent / 'report.md'}")


def _cmd_train(args: argparse.Namespace) -> int:
    from selfdistill.train.config import describe_fields, load_config
    from selfdistill.train.run import run_training

    if args.help_config:
        print("\n".join(describe_fields()))
        return 0
    overrides = list(args.overrides)
    config = args.config
    if args.resume:
        run_dir = Path(args.resume)
        if config is not None and "=" in config:
            overrides.insert(0, config)
        config = run_dir / "config.yaml"
        if not config.is_file():
            raise UserError(f"--resume {run_dir}: no config.yaml there (not a run directory)")
        overrides.append(f"output_dir={run_dir}")
    elif config is None:
        raise UserError("give a config file: selfdistill train CONFIG.yaml [key=value ...]")
    elif "=" in config and not Path(config).exists():
        raise UserError(f"{config!r} looks like an override; put the config file first")
    cfg = load_config(config, overrides)
    summary = run_training(cfg, resume=bool(args.resume), progress=not args.quiet)
    if "gate" in summary:  # data-parallel ranks other than 0 return {"rank": r}
        _print_summary(summary)
    return 0


def add_subcommand(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("train", help="run a self-distillation training job",
                              description="Train an adapter from CONFIG.yaml; any config key "
                              "can be overridden as key=value (e.g. steps=20 loss.alpha=1).")
    p.add_argument("config", nargs="?", default=None, help="YAML config file")
    p.add_argument("overrides", nargs="*", help="key=value overrides (dotted for sections)")
    p.add_argument("--resume", metavar="RUN_DIR", default=None,
                   help="continue the run in RUN_DIR from its latest checkpoint")
    p.add_argument("--help-config", action="store_true", help="list every config key")
    p.set_defaults(func=_cmd_train)
