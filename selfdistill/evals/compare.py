"""``selfdistill compare RUN_DIR ...``: training runs side by side (e.g. SDPO against GRPO).

Reads each run directory's `summary.json` and `evals.jsonl` and writes `comparison.md` (one
column per run: accuracy per suite before → after, the generation budget, wall time, gate
verdict) and `comparison.png` (accuracy of the gate's task suite over steps, one line per run).
Runs compared this way should share their data and budget; the table states the budget of
each so a mismatch is visible.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from selfdistill.errors import UserError


def load_run(run_dir: str | Path) -> dict[str, Any]:
    """A finished run's summary plus its evaluation history (`evals`, a list per eval point)."""
    run_dir = Path(run_dir)
    path = run_dir / "summary.json"
    if not path.is_file():
        raise UserError(f"{run_dir}: no summary.json; is this a finished training run "
                        "directory (`selfdistill train` writes it at the end)?")
    summary = json.loads(path.read_text())
    evals_path = run_dir / "evals.jsonl"
    summary["evals"] = ([json.loads(x) for x in evals_path.read_text().splitlines() if x.strip()]
                        if evals_path.is_file() else [])
    summary["run_dir"] = str(run_dir)
    return summary


def _label(run: dict[str, Any]) -> str:
    return f"{run['config']['method']} ({Path(run['run_dir']).name})"


def generations(run: dict[str, Any]) -> int:
    """Completions sampled for training: steps × batch_size × num_generations."""
    c = run["config"]
    return c["steps"] * c["batch_size"] * c["num_generations"]


def comparison_markdown(runs: list[dict[str, Any]]) -> str:
    """The comparison table: accuracy per suite as `before → after (correct/n)` per run."""
    head = "| | " + " | ".join(_label(r) for r in runs) + " |"
    lines = ["# Runs compared", "", head, "|---" * (len(runs) + 1) + "|"]

    def row(name: str, cells: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    suites = sorted({s for r in runs for s in r["after"]})
    for s in suites:
        cells = []
        for r in runs:
            b, a = r["before"].get(s), r["after"].get(s)
            cells.append("—" if a is None else
                         f"{100 * b['accuracy']:.1f} % → **{100 * a['accuracy']:.1f} %** "
                         f"({b['correct']}→{a['correct']}/{a['n']})")
        row(f"{s} accuracy", cells)
    row("training generations", [str(generations(r)) for r in runs])
    row("steps × prompts × group", [f"{r['config']['steps']} × {r['config']['batch_size']} × "
                                    f"{r['config']['num_generations']}" for r in runs])
    row("training wall time", [f"{r['train_seconds']:.0f} s" for r in runs])
    row("gate", [r["gate"]["summary"] for r in runs])
    budgets = {generations(r) for r in runs}
    if len(budgets) > 1:
        lines += ["", "**Warning:** the runs sampled different numbers of training "
                  "generations; the comparison is not on an equal budget."]
    return "\n".join(lines) + "\n"


def plot_comparison(runs: list[dict[str, Any]], out: Path) -> Path:
    """Accuracy of each run's gate task suite at its evaluation points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in runs:
        task = r["config"]["gate"]["task"]
        pts = [(e["step"], e["suites"][task]["accuracy"]) for e in r["evals"]
               if task in e["suites"]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"{_label(r)}: {task}")
    ax.set_xlabel("step")
    ax.set_ylabel("strict accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def add_subcommand(subparsers: Any) -> None:
    p = subparsers.add_parser("compare", help="training runs side by side (report + plot)")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="finished training run directories")
    p.add_argument("--out", default=None, help="directory for comparison.md / comparison.png "
                   "(default: the first run's parent directory)")
    p.set_defaults(func=_cmd)


def _cmd(args: argparse.Namespace) -> int:
    runs = [load_run(d) for d in args.runs]
    out = Path(args.out) if args.out else Path(args.runs[0]).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    md = comparison_markdown(runs)
    (out / "comparison.md").write_text(md)
    plot_comparison(runs, out / "comparison.png")
    print(md, end="")
    print(f"\nwrote {out / 'comparison.md'} and {out / 'comparison.png'}")
    return 0
