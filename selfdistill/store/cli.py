"""``selfdistill traces ...``: read the trace store from the command line.

    selfdistill traces export RUN_DIR --format jsonl [--out FILE]
    selfdistill traces export RUN_ID --store URL_OR_PATH --format jsonl [--out FILE]
    selfdistill traces replay RUN_DIR --step N        (or RUN_ID --store URL_OR_PATH)

RUN_DIR is a training run directory: its ``traces.db``, or (``trace_store`` set to a URL) the
store its ``config.yaml`` names and the run its ``run_id`` file names. ``replay`` needs the
trainer (`selfdistill.train.replay`), imported only when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from selfdistill.errors import UserError
from selfdistill.store.store import DB_FILENAME, TraceStore

RUN_HELP = "a run directory (holding traces.db, or run_id), or a run id/name with --store"
STORE_HELP = "the trace store: a database URL, a traces.db file or a run directory"


def add_subcommand(subparsers: Any) -> None:
    """Register ``traces`` (with ``export``) on the main parser's `add_subparsers()` object."""
    traces = subparsers.add_parser("traces", help="read the trace store (export)")
    actions = traces.add_subparsers(dest="traces_command", required=True)
    export = actions.add_parser(
        "export",
        help="write a run's attempts with their feedback, teacher contexts and steps",
        description="One JSON object per attempt, with its feedback, teacher contexts and the "
        "training steps that consumed it.",
    )
    export.add_argument("run", metavar="RUN", help=RUN_HELP)
    export.add_argument("--format", choices=["jsonl"], default="jsonl", help="output format")
    export.add_argument("--out", metavar="FILE", help="output file (standard output if omitted)")
    export.add_argument("--store", metavar="URL_OR_PATH", help=STORE_HELP)
    export.set_defaults(func=export_command)
    replay = actions.add_parser(
        "replay",
        help="recompute a recorded step's loss from the store and the checkpoint before it",
        description="Rebuild training step N's batch from the trace store, load the checkpoint "
        "written right before it (the base model for step 1), recompute the loss of its first "
        "update and print JSON {step, logged_loss, replayed_loss, abs_diff, match}. Exit code 1 "
        "when the losses differ.",
    )
    replay.add_argument("run", metavar="RUN", help=RUN_HELP)
    replay.add_argument("--step", type=int, required=True, help="training step (1-based)")
    replay.add_argument("--store", metavar="URL_OR_PATH", help=STORE_HELP)
    replay.set_defaults(func=replay_command)


def _open(value: str) -> TraceStore:
    if "://" in value:
        return TraceStore(value)
    path = Path(value)
    db = path / DB_FILENAME if path.is_dir() else path
    if not db.is_file():  # opening would create an empty store: a typo deserves an error
        raise UserError(f"{value}: no trace store here (expected {DB_FILENAME} or a .db file)")
    return TraceStore(path=db)


def _run_of_directory(store: TraceStore, run_dir: Path, command: str) -> dict[str, Any]:
    id_file = run_dir / "run_id"  # written by the trainer (selfdistill.train.traces)
    if id_file.is_file():
        return store.get_run(id_file.read_text().strip())
    runs = store.runs()
    if len(runs) == 1:
        return runs[0]
    named = [r for r in runs if r["name"] == run_dir.name]
    if len(named) == 1:
        return named[0]
    ids = ", ".join(r["id"] for r in runs) or "none"
    raise UserError(
        f"{run_dir}: the store holds {len(runs)} runs ({ids}); name one: "
        f"selfdistill traces {command} RUN_ID --store {run_dir}"
    )


def _store_of_directory(run_dir: Path) -> TraceStore:
    if (run_dir / DB_FILENAME).is_file():
        return _open(str(run_dir))
    config = run_dir / "config.yaml"
    url = None
    if config.is_file() and (run_dir / "run_id").is_file():
        url = (yaml.safe_load(config.read_text()) or {}).get("trace_store")
    if not isinstance(url, str) or "://" not in url:
        raise UserError(
            f"{run_dir}: not a run directory with {DB_FILENAME} (or with run_id and a "
            "trace_store URL in config.yaml); pass one, or pass a run id with --store URL_OR_PATH"
        )
    return TraceStore(url)


def open_run(ref: str, store_ref: str | None, command: str) -> tuple[TraceStore, dict[str, Any]]:
    """The store and run that ``RUN [--store URL_OR_PATH]`` name; the caller closes the store."""
    store = _open(store_ref) if store_ref is not None else _store_of_directory(Path(ref))
    try:
        if store_ref is not None:
            return store, store.find_run(ref)
        return store, _run_of_directory(store, Path(ref), command)
    except BaseException:
        store.close()
        raise


def export_command(args: argparse.Namespace) -> int:
    """Handler of ``traces export``; returns the exit code."""
    store, run = open_run(args.run, args.store, "export")
    with store:
        if args.out is None:
            n = store.export_jsonl(run["id"], sys.stdout)
            sys.stdout.flush()
        else:
            n = store.export_jsonl(run["id"], args.out)
    where = args.out or "standard output"
    print(f"exported {n} attempts of run {run['id']} ({run['name']}) to {where}", file=sys.stderr)
    return 0


def replay_command(args: argparse.Namespace) -> int:
    """Handler of ``traces replay``: prints the JSON result; exit code 1 when it differs."""
    from selfdistill.train.replay import replay_step

    store, run = open_run(args.run, args.store, "replay")
    with store:
        run_dir = Path(args.run) if args.store is None else None
        result = replay_step(store, run["id"], args.step, run_dir=run_dir)
    print(json.dumps(result, indent=2))
    return 0 if result["match"] else 1
