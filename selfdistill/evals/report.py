"""The run report: `report.md` (before/after table, gate verdict, timings) and `plot.png`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.1f} %"


def write_report(run_dir: Path, summary: dict[str, Any], metrics: list[dict[str, Any]]) -> Path:
    """Write `report.md` from the run summary (config, evals, gate) and the step metrics."""
    cfg, before, after = summary["config"], summary["before"], summary["after"]
    oracle, gate = summary.get("oracle", {}), summary["gate"]
    lines = [f"# Training report: {cfg['method']} on {summary['model']}", "",
             f"Run directory: `{run_dir}`  ", f"Steps: {summary['steps']} · "
             f"wall time: {summary['train_seconds']:.0f} s training, "
             f"{summary['total_seconds']:.0f} s in all · forward precision: "
             f"{summary.get('precision', cfg.get('precision', 'float32'))}", "",
             "## Accuracy (strict: the answer string occurs in the greedy completion; "
             "rows with a `rule`: the completion follows it)", "",
             "| suite | n | before | after | oracle (context in prompt) |",
             "|---|---:|---:|---:|---:|"]
    for name in after:
        n = after[name]["n"]
        lines.append(f"| {name} | {n} | {_pct(before.get(name, {}).get('accuracy'))} | "
                     f"{_pct(after[name]['accuracy'])} | "
                     f"{_pct(oracle.get(name, {}).get('accuracy'))} |")
    lines += ["", f"## Gate verdict: **{gate['summary']}**", "",
              "| check | rule | before | after | passed |", "|---|---|---:|---:|---|"]
    for c in gate["checks"]:
        lines.append(f"| {c['name']} | {c['rule']} | {c['before']:g} | {c['after']:g} | "
                     f"{'yes' if c['passed'] else 'no'} |")
    if metrics:
        phases = sorted({k for m in metrics for k in m if k.startswith("time_")})
        lines += ["", "## Where the time went (median seconds per step)", "",
                  "| phase | median s |", "|---|---:|"]
        for p in phases:
            lines.append(f"| {p[5:]} | {np.median([m[p] for m in metrics if p in m]):.2f} |")
        tps = [m["tokens_per_s"] for m in metrics if "tokens_per_s" in m]
        if tps:
            lines.append(f"| (tokens per second, median) | {np.median(tps):.1f} |")
    lines += ["", "## Config", "", "```yaml", summary["config_yaml"].rstrip(), "```", ""]
    path = run_dir / "report.md"
    path.write_text("\n".join(lines))
    return path


def plot_run(run_dir: Path, metrics: list[dict[str, Any]], evals: list[dict[str, Any]]) -> Path:
    """`plot.png`: loss and rollout accuracy per step (left), suite accuracy at eval points
    (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [m["step"] for m in metrics if m.get("loss") is not None]
    ax1.plot(steps, [m["loss"] for m in metrics if m.get("loss") is not None], label="loss")
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ra = [(m["step"], m["rollout_accuracy"]) for m in metrics if "rollout_accuracy" in m]
    if ra:
        ax1b = ax1.twinx()
        ax1b.plot(*zip(*ra, strict=True), color="tab:orange", alpha=0.6,
                  label="rollout accuracy")
        ax1b.set_ylabel("rollout accuracy")
        ax1b.set_ylim(-0.05, 1.05)
        ax1b.legend(loc="upper right")
    ax1.legend(loc="upper left")
    ax1.set_title("training")
    names = sorted({k for e in evals for k in e["suites"]})
    for name in names:
        pts = [(e["step"], e["suites"][name]["accuracy"]) for e in evals if name in e["suites"]]
        ax2.plot(*zip(*pts, strict=True), marker="o", label=name)
    ax2.set_xlabel("step")
    ax2.set_ylabel("strict accuracy")
    ax2.set_ylim(-0.05, 1.05)
    ax2.legend()
    ax2.set_title("evaluation")
    fig.tight_layout()
    path = run_dir / "plot.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
