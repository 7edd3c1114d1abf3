"""The promotion gate: evaluate a candidate adapter and the scope's active one (or the base model)
side by side, greedy, on the same suites, and decide with `selfdistill.evals.gate.decide`.

Rules, one `GateCheck` each; the gate passes when all pass:
- task suite, ``must: improve``: candidate accuracy − baseline accuracy > `min_gain` (strictly,
  as the training gate's `min_improvement`); ``must: not_regress``: it falls by at most
  `tolerance` (absolute fraction, inclusive).
- forgetting probes (all probe files as one suite): at most `probe_tolerance` probes are lost,
  counted as in training: baseline correct − candidate correct.
- custom check ``module:function``: called as ``function(model, tokenizer)`` on the candidate
  (and on the baseline, for its `value` as "before"); returns a mapping with ``passed`` (bool) and
  optionally ``value`` (number) and ``rule`` (text). A check that raises fails.

A spec is YAML or JSON with the fields of `GateSpec`; relative paths are relative to its file.
"""

from __future__ import annotations

import copy
import importlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from selfdistill.data import Row, is_graded, load_rows
from selfdistill.errors import UserError
from selfdistill.evals.gate import GateCheck, GateVerdict, decide

BUILTIN = "builtin"
Check = Callable[[Any, Any], Mapping[str, Any]]


class TaskSuite(BaseModel):
    """An evaluation suite (JSONL rows with `answer`, or code rows with `tests`) and its rule."""

    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="JSONL file of evaluation rows")
    must: Literal["improve", "not_regress"] = Field("improve", description="the rule")
    min_gain: float = Field(
        0.0,
        description="improve: required accuracy gain, strictly "
        "greater than this (absolute fraction)",
    )
    tolerance: float = Field(
        0.0,
        ge=0,
        description="not_regress: accuracy that may be lost (absolute fraction, inclusive)",
    )


class GateSpec(BaseModel):
    """What a promotion must pass. `default_spec` fills it from the candidate's training run."""

    model_config = ConfigDict(extra="forbid")
    tasks: dict[str, TaskSuite] = Field(default_factory=dict, description="task suites by name")
    probes: list[str] = Field(
        default_factory=lambda: [BUILTIN],
        description="forgetting probe "
        "JSONL files, evaluated as one suite; 'builtin' = the packaged "
        "general-knowledge probes; [] = no probe check",
    )
    probe_tolerance: int = Field(1, ge=0, description="probes that may be lost (count)")
    checks: list[str | Check] = Field(
        default_factory=list,
        description="custom checks: module:function (the Python API also takes callables)",
    )
    max_new_tokens: int = Field(64, gt=0, description="greedy answer budget (tokens)")
    batch_size: int = Field(16, gt=0, description="prompts per generation batch")


def _invalid(exc: ValidationError, where: str) -> UserError:
    errs = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
    fields = ", ".join(GateSpec.model_fields)
    return UserError(f"{where}: invalid gate spec: {errs} (fields: {fields})")


def default_spec(config: Mapping[str, Any]) -> GateSpec:
    """The gate a training config implies: its `gate.task` suite must improve by more than
    `gate.min_improvement`, its other suites must not regress, the packaged probes (plus its own
    `probe_data`) may lose `gate.probe_tolerance`; answers as long as its `eval.max_new_tokens`."""
    gate, ev = config.get("gate") or {}, config.get("eval") or {}
    task = gate.get("task", "train")
    paths = dict(config.get("eval_data") or {})
    if config.get("train_data"):
        paths.setdefault("train", config["train_data"])
    tasks = {
        name: TaskSuite(path=str(p), must="improve", min_gain=float(gate.get("min_improvement", 0)))
        if name == task
        else TaskSuite(path=str(p), must="not_regress")
        for name, p in paths.items()
    }
    probes = [BUILTIN]
    if config.get("probe_data") not in (None, BUILTIN):
        probes.append(str(config["probe_data"]))
    return GateSpec(
        tasks=tasks,
        probes=probes,
        probe_tolerance=int(gate.get("probe_tolerance", 1)),
        max_new_tokens=int(ev.get("max_new_tokens", 64)),
        batch_size=int(ev.get("batch_size", 16)),
    )


def load_spec(path: str | Path, base: GateSpec | None = None) -> GateSpec:
    """Read a YAML/JSON spec; its keys replace those of `base` (default: `GateSpec()`)."""
    path = Path(path)
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise UserError(f"{path}: cannot read the gate spec ({exc})") from None
    if not isinstance(tree, dict):
        raise UserError(f"{path}: a gate spec is a mapping, e.g. {{probe_tolerance: 1}}")
    here = path.resolve().parent

    def rel(p: Any) -> Any:  # data paths in the file are relative to the file
        keep = not isinstance(p, str) or p == BUILTIN or Path(p).is_absolute()
        return p if keep else str(here / p)

    for suite in (tree.get("tasks") or {}).values():
        if isinstance(suite, dict) and "path" in suite:
            suite["path"] = rel(suite["path"])
    if isinstance(tree.get("probes"), list):
        tree["probes"] = [rel(p) for p in tree["probes"]]
    try:
        return GateSpec.model_validate({**(base or GateSpec()).model_dump(), **tree})
    except ValidationError as exc:
        raise _invalid(exc, str(path)) from None


def resolve_check(ref: str | Check) -> tuple[str, Check]:
    """(name, callable) of a custom check given as ``module:function`` or as a callable."""
    if callable(ref):
        return f"{ref.__module__}:{ref.__qualname__}", ref
    module, sep, attr = ref.partition(":")
    if not (module and sep and attr):
        raise UserError(f"custom check {ref!r}: expected module:function, e.g. mychecks:no_pii")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise UserError(
            f"custom check {ref!r}: cannot import it ({exc}); is the module on PYTHONPATH?"
        ) from None
    if not callable(fn):
        raise UserError(f"custom check {ref!r} is not callable")
    return ref, fn


def load_suites(spec: GateSpec) -> dict[str, list[Row]]:
    """The spec's rows: each task suite by name, and the probes as ``"probes"`` (validated
    before any model is loaded). Task rows without a grader (`answer` / `tests`) are skipped."""
    from selfdistill.train.run import BUILTIN_PROBES

    suites: dict[str, list[Row]] = {}
    for name, suite in spec.tasks.items():
        rows = [
            r
            for r in load_rows(suite.path, purpose=f"gate suite {name!r}")
            if is_graded(r) or "tests" in r.extra
        ]
        if not rows:
            raise UserError(
                f"gate suite {name!r} ({suite.path}): no row has an 'answer' or "
                "'tests' to score it by"
            )
        suites[name] = rows
    if "probes" in suites:
        raise UserError("'probes' names the forgetting-probe suite: rename that task suite")
    probes = []
    for p in spec.probes:
        probes += load_rows(
            BUILTIN_PROBES if p == BUILTIN else p, require=("prompt", "answer"), purpose="probe"
        )
    if probes:
        suites["probes"] = probes
    return suites


@dataclass
class GateOutcome:
    """The verdict, every suite's scores ({accuracy, correct, n}) before (baseline) and after
    (candidate), what custom checks returned, the spec, and the seconds it took."""

    verdict: GateVerdict
    before: dict[str, dict[str, Any]]
    after: dict[str, dict[str, Any]]
    custom: dict[str, Any]
    spec: dict[str, Any]
    seconds: float


def _score(
    model: Any, tok: Any, suites: dict[str, list[Row]], spec: GateSpec, progress: bool
) -> dict[str, dict[str, Any]]:
    from selfdistill.evals.accuracy import evaluate
    from selfdistill.evals.code import evaluate_code, has_tests

    out = {}
    for name, rows in suites.items():
        score = evaluate_code if any(has_tests(r) for r in rows) else evaluate
        rep = score(
            model,
            tok,
            rows,
            max_new_tokens=spec.max_new_tokens,
            batch_size=spec.batch_size,
            progress=progress,
            desc=f"gate {name}",
        )
        out[name] = {"accuracy": rep.accuracy, "correct": rep.correct, "n": rep.n}
    return out


def _value(res: Mapping[str, Any]) -> float:
    try:
        return float(res.get("value", res["passed"]))
    except (TypeError, ValueError):
        return float(res["passed"])


def _call(fn: Check, model: Any, tok: Any) -> dict[str, Any]:
    try:
        res = dict(fn(model, tok))
        return {**res, "passed": bool(res.get("passed", False))}
    except Exception as exc:  # a broken check must fail the gate, not crash the promotion
        return {"passed": False, "error": f"{type(exc).__name__}: {exc}"}


def _checks(spec: GateSpec, before: dict, after: dict) -> list[GateCheck]:
    out = []
    for name, suite in spec.tasks.items():
        # decide's task rule is "gain > min_improvement"; not_regress means gain >= -tolerance,
        # so shift by a hair below any difference two accuracies of real suites can have.
        margin = suite.min_gain if suite.must == "improve" else -suite.tolerance - 1e-9
        [check] = decide(
            {name: before[name]},
            {name: after[name]},
            task=name,
            min_improvement=margin,
            probe_tolerance=0,
        ).checks
        if suite.must == "not_regress":
            check.rule = f"accuracy loss ≤ {suite.tolerance:g}"
        out.append(check)
    if "probes" in after:
        # decide scores a task suite first; with no floor on it, its second check is the probes'.
        probes = {"probes": before["probes"]}, {"probes": after["probes"]}
        out.append(
            decide(
                *probes, task="probes", min_improvement=-2.0, probe_tolerance=spec.probe_tolerance
            ).checks[1]
        )
    return out


def evaluate_gate(
    spec: GateSpec,
    model: Any,
    tokenizer: Any,
    candidate_dir: Path,
    baseline_dir: Path | None,
    *,
    progress: bool = False,
) -> GateOutcome:
    """Evaluate the candidate adapter and the baseline (an adapter directory, or None = `model`
    itself) on `spec`'s suites and decide. `model` (the base) is not modified: adapters are
    applied to copies."""
    from selfdistill.models import load_adapter

    t0 = time.perf_counter()
    suites = load_suites(spec)
    fns = [resolve_check(c) for c in spec.checks]
    scored: list[tuple[dict, dict]] = []
    for adapter in (baseline_dir, candidate_dir):
        m = model if adapter is None else load_adapter(copy.deepcopy(model), adapter)
        scored.append(
            (
                _score(m, tokenizer, suites, spec, progress),
                {name: _call(fn, m, tokenizer) for name, fn in fns},
            )
        )
        del m
    (before, custom_b), (after, custom_a) = scored
    checks = _checks(spec, before, after)
    for name, _ in fns:
        a, b = custom_a[name], custom_b[name]
        rule = a.get("rule") or (f"raised {a['error']}" if "error" in a else "custom: passed")
        checks.append(GateCheck(f"check:{name}", a["passed"], _value(b), _value(a), str(rule)))
    verdict = GateVerdict(all(c.passed for c in checks), checks)
    custom = json.loads(json.dumps({"before": custom_b, "after": custom_a}, default=str))
    stored = {**spec.model_dump(), "checks": [name for name, _ in fns]}  # callables by name
    return GateOutcome(verdict, before, after, custom, stored, time.perf_counter() - t0)
