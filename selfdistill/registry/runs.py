"""What a training run directory says about the adapter it produced (`selfdistill train`):
``adapter/`` (PEFT), ``summary.json`` (model, config, before/after suites, gate), ``config.yaml``
and the trace store that recorded which attempts each step consumed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from selfdistill.errors import UserError
from selfdistill.registry.weights import check_adapter_dir
from selfdistill.store.records import check_scope

METRIC_KEYS = ("steps", "before", "after", "oracle", "train_seconds", "total_seconds")
"""The keys of ``summary.json`` kept as a version's training metrics."""


@dataclass
class RunRecord:
    """A run's adapter and its provenance, read from its directory."""

    run_dir: Path
    adapter_dir: Path
    scope: str
    base_model: str  # as configured ("default" = the embedded model)
    base_path: str | None  # what was loaded: a directory, or a hub id
    config: dict[str, Any]
    metrics: dict[str, Any]
    train_gate: dict[str, Any] | None
    run_id: str | None = None
    run_name: str | None = None
    data_ids: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        obj = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: unreadable ({exc}); is the run complete?") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected a JSON object")
    return obj


def _trace_ids(run_dir: Path) -> tuple[str | None, str | None, list[str]]:
    """(run id, run name, attempt ids consumed) from the run's trace store, if it has one."""
    from selfdistill.store.cli import open_run
    from selfdistill.store.store import DB_FILENAME

    if not (run_dir / DB_FILENAME).is_file() and not (run_dir / "run_id").is_file():
        return None, None, []  # trained with trace_store=null: no evidence recorded
    store, run = open_run(str(run_dir), None, "export")
    with store:
        return run["id"], run["name"], store.attempts_consumed(run["id"])


def read_run(run_dir: str | Path) -> RunRecord:
    """Read a finished run directory; UserError naming what is missing otherwise."""
    run_dir = Path(run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: no such run directory (the output_dir of selfdistill train)")
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise UserError(f"{run_dir}: no summary.json; propose a finished run of selfdistill train")
    summary = _read_json(summary_path)
    adapter_dir = Path(summary.get("adapter") or run_dir / "adapter")
    if not adapter_dir.is_dir():  # the run directory may have moved since it was written
        adapter_dir = run_dir / "adapter"
    check_adapter_dir(adapter_dir)
    config = summary.get("config")
    if not isinstance(config, dict) and (run_dir / "config.yaml").is_file():
        config = yaml.safe_load((run_dir / "config.yaml").read_text())
    if not isinstance(config, dict):
        raise UserError(f"{run_dir}: neither summary.json nor config.yaml holds the config")
    run_id, run_name, data_ids = _trace_ids(run_dir)
    return RunRecord(
        run_dir=run_dir,
        adapter_dir=adapter_dir,
        scope=check_scope(str(config.get("scope") or "global")),
        base_model=str(config.get("model") or "default"),
        base_path=summary.get("model_path"),
        config=config,
        metrics={k: summary[k] for k in METRIC_KEYS if k in summary},
        train_gate=summary.get("gate"),
        run_id=run_id,
        run_name=run_name or run_dir.name,
        data_ids=data_ids,
    )


def base_sha256(base_path: str | None) -> str | None:
    """Content hash of a base model directory's safetensors weights (the trace store's rule for
    checkpoints); None for a hub id or a directory without safetensors."""
    if base_path is None or not Path(base_path).is_dir():
        return None
    from selfdistill.train.traces import weights_sha256

    return weights_sha256(Path(base_path))
