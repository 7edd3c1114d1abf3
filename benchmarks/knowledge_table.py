"""The knowledge table: Base / Oracle / CPT / SFT / SDFT (frozen-base and EMA teacher) on the
bundled fictional facts (examples/knowledge), same optimizer-step budget for every method.

Each (method, seed) is one `selfdistill train examples/knowledge.yaml` job with overrides: the
method, its learning rate, ``--steps``, the seed; no trace store, no intermediate evaluations,
no checkpoints but the last. Reported per method: strict accuracy on the training questions,
on the held-out paraphrases and on the forgetting probes (greedy answers), mean and standard
deviation over the seeds, and the probe drop from Base. Base is the "before" evaluation and
Oracle the base model with the fact in its prompt (the teacher's ceiling); both are greedy, so
they do not depend on the seed.

Learning rates (``--lr ARM=VALUE`` to change one): SDFT 3.5e-3 is the knowledge recipe's, tuned
on this set (README "Results of the main job"); SFT and CPT default to 3e-3 unless
``--tune`` is given, which first runs every trained arm at its learning rate times each of
``--tune-factors`` (0.5 1 2) on the first seed and keeps the best training-question accuracy
(ties: paraphrases, then probes); the chosen run is that seed's row, not run again.

    .venv/bin/python benchmarks/knowledge_table.py                     # CPU default (~15 min
                                                                       # on an idle 2-core box)
    .venv/bin/python benchmarks/knowledge_table.py --seeds 0 1 2 --steps 20 --tune   # the table
    .venv/bin/python benchmarks/knowledge_table.py --seeds 2 --steps 20 \
        --merge benchmarks/results/knowledge_table.json              # add a seed to a table
    .venv/bin/python benchmarks/knowledge_table.py --quick             # CI smoke: tiny model
Results: benchmarks/results/knowledge_table{_quick}.md / .json / .png.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from common import (
    ROOT,
    base_parser,
    header,
    loadavg,
    md_table,
    mean_std,
    publish,
    pyplot,
    save_figure,
    tiny_model_dir,
    train_job,
)

# The SDFT arms run the shipped recipe (examples/knowledge.yaml, with its anchor rollouts); CPT
# and SFT make no rollouts, so they cannot have anchors.
ARMS: dict[str, list[str]] = {
    "CPT": ["method=cpt", "anchor_batch_size=0", "anchor_data=null"],
    "SFT": ["method=sft", "anchor_batch_size=0", "anchor_data=null"],
    "SDFT (base teacher)": ["method=sdft", "teacher.regime=base"],
    "SDFT (EMA teacher)": ["method=sdft", "teacher.regime=ema"],
    # the recipe samples at temperature 0.7; closer to greedy, the student's samples follow the
    # path its greedy answer takes, which is what the evaluation reads
    "SDFT (base teacher, temperature 0.5)": ["method=sdft", "teacher.regime=base",
                                             "temperature=0.5"],
}
DEFAULT_LR = {"CPT": 3e-3, "SFT": 3e-3, "SDFT (base teacher)": 3.5e-3, "SDFT (EMA teacher)": 3.5e-3,
              "SDFT (base teacher, temperature 0.5)": 3.5e-3}
SUITES = ("train", "paraphrases", "probes")


def run_arm(overrides: list[str], out_dir: Path) -> dict[str, Any]:
    """One knowledge training job; its summary (before / after / oracle accuracies)."""
    return train_job(ROOT / "examples" / "knowledge.yaml",
                     [*overrides, "checkpoint_every=0", "eval.every_steps=0"], out_dir)


def _slug(name: str) -> str:
    return re.sub(r"\W+", "_", name)


def accuracies(evals: dict[str, Any]) -> dict[str, float]:
    return {s: evals[s]["accuracy"] for s in SUITES if s in evals}


class Jobs:
    """The table's training jobs, each (arm, seed, lr) run at most once, so the learning-rate
    search's runs on the first seed are the table's runs there. Base and Oracle come from the
    first job's "before" and "oracle" evaluations (greedy: they do not depend on the seed)."""

    def __init__(self, common: list[str], work: Path):
        self.common, self.work = common, work
        self.done: dict[tuple[str, int, float], dict[str, float]] = {}
        self.base: dict[str, float] | None = None
        self.oracle: dict[str, float] | None = None
        self.precision: str | None = None

    def __call__(self, arm: str, seed: int, lr: float) -> dict[str, float]:
        """Accuracies after training ``arm`` with ``seed`` and learning rate ``lr``."""
        key = (arm, seed, lr)
        if key not in self.done:
            print(f"{arm} seed {seed} lr {lr:g} (load {loadavg()})", file=sys.stderr, flush=True)
            oracle = "eval.oracle=true" if self.oracle is None else "eval.oracle=false"
            summary = run_arm([*ARMS[arm], *self.common, f"seed={seed}", f"learning_rate={lr}",
                               oracle], self.work / f"{_slug(arm)}-{seed}-{lr:g}")
            self.done[key] = accuracies(summary["after"])
            if self.base is None:
                self.base = accuracies(summary["before"])
            if self.oracle is None:
                self.oracle = accuracies(summary["oracle"])
            self.precision = summary["precision"]
        return self.done[key]


def run_table(jobs: Jobs, arms: list[str], seeds: list[int], lrs: dict[str, float]
              ) -> dict[str, Any]:
    """Every arm x seed at the arm's learning rate."""
    runs = {arm: [jobs(arm, seed, lrs[arm]) for seed in seeds] for arm in arms}
    return {"runs": runs, "base": jobs.base, "oracle": jobs.oracle, "precision": jobs.precision}


def planned_precision() -> str:
    """The precision the knowledge recipe resolves to on this machine's CPU."""
    import torch

    from selfdistill.train.config import load_config
    from selfdistill.train.loop import resolve_precision

    cfg = load_config(ROOT / "examples" / "knowledge.yaml", [])
    return resolve_precision(cfg.precision, torch.device("cpu"))


def check_mergeable(earlier: dict[str, Any], planned: dict[str, Any], source: Path) -> None:
    """Raise ValueError naming what differs unless ``planned`` (steps, lrs, arms, seeds,
    precision) is the same experiment as the earlier table with new seeds. An earlier table
    written before "precision" was recorded is taken at its word."""
    keys = ["steps", "lrs"] + (["precision"] if "precision" in earlier else [])
    diffs = [f"{key}: {earlier.get(key)!r} there, {planned[key]!r} here"
             for key in keys if earlier.get(key) != planned[key]]
    if set(earlier["runs"]) != set(planned["arms"]):
        diffs.append(f"arms: {sorted(earlier['runs'])} there, {sorted(planned['arms'])} here")
    if overlap := set(earlier["seeds"]) & set(planned["seeds"]):
        diffs.append(f"seeds {sorted(overlap)} are in both")
    if diffs:
        raise ValueError(f"--merge {source}: not the same experiment ({'; '.join(diffs)}); "
                         "run the same --steps, --arms and --lr, on a machine of the same "
                         "precision, with new --seeds")


def merge(earlier: dict[str, Any], res: dict[str, Any]) -> dict[str, Any]:
    """``res`` with the earlier table's seeds and runs in front (``check_mergeable`` first)."""
    seeds = [*earlier["seeds"], *res["seeds"]]
    runs = {arm: [*earlier["runs"][arm], *res["runs"][arm]] for arm in earlier["runs"]}
    return {**res, "runs": runs, "seeds": seeds, "n_seeds": len(seeds),
            "tuning": earlier.get("tuning") or res.get("tuning")}


def tune(jobs: Jobs, arms: list[str], lrs: dict[str, float], factors: list[float], seed: int
         ) -> tuple[dict[str, float], dict[str, Any]]:
    """Each arm's best learning rate among ``lrs[arm] x factors`` on one seed: highest
    training-question accuracy, ties broken by paraphrases, then probes."""
    best: dict[str, float] = {}
    tried: dict[str, Any] = {}
    for arm in arms:
        scores = {lr: jobs(arm, seed, lr) for lr in sorted({lrs[arm] * f for f in factors})}
        best[arm] = max(scores, key=lambda lr: tuple(scores[lr].get(s, 0.0) for s in SUITES))
        tried[arm] = {f"{lr:g}": acc for lr, acc in scores.items()}
    return best, tried


def render(res: dict[str, Any], settings: str, load: tuple[str, str]) -> str:
    base, oracle = res["base"], res["oracle"]
    rows = [["Base", *(f"{100 * base.get(s, float('nan')):.1f}" for s in SUITES), "0.0", "—"],
            ["Oracle (fact in prompt)",
             *(f"{100 * oracle[s]:.1f}" if s in oracle else "—" for s in SUITES), "—", "—"]]
    stats: dict[str, dict[str, tuple[float, float]]] = {}
    for arm, runs in res["runs"].items():
        stats[arm] = {s: mean_std([r[s] for r in runs]) for s in SUITES}
        drop = mean_std([base["probes"] - r["probes"] for r in runs]) if "probes" in base else (
            float("nan"), float("nan"))
        stats[arm]["drop"] = drop
        rows.append([arm, *(f"{100 * m:.1f} ± {100 * sd:.1f}" for m, sd in
                            (stats[arm][s] for s in SUITES)),
                     f"{100 * drop[0]:.1f} ± {100 * drop[1]:.1f}", f"{res['lrs'][arm]:g}"])
    lines = [header("Knowledge table: learning new facts without forgetting", settings, *load),
             md_table(["method", "training questions (%)", "paraphrases (%)",
                       "forgetting probes (%)", "probe drop (pts)", "lr"], rows), "",
             f"Mean ± standard deviation over {res['n_seeds']} seed(s) (± 0.0 with one seed is "
             "no spread estimate)."]
    sd, sft = stats.get("SDFT (base teacher)"), stats.get("SFT")
    if sd and sft and "train" in oracle:
        checks = [
            ("SDFT >= 0.9 x Oracle on training questions",
             sd["train"][0] >= 0.9 * oracle["train"]),
            ("SDFT >= SFT on paraphrases", sd["paraphrases"][0] >= sft["paraphrases"][0]),
            ("SDFT probe drop <= SFT's", sd["drop"][0] <= sft["drop"][0]),
        ]
        lines += ["", "Targets (SDFT with the frozen-base teacher): " + "; ".join(
            f"{name}: {'met' if ok else 'NOT met'}" for name, ok in checks) + "."]
    if res.get("tuning"):
        rows = [[arm, lr + (" (chosen)" if float(lr) == res["lrs"].get(arm) else ""),
                 *(f"{100 * acc[s]:.1f}" if s in acc else "—" for s in SUITES)]
                for arm, tried in res["tuning"].items() for lr, acc in tried.items()]
        lines += ["", f"Learning-rate search on seed {res['seeds'][0]} (accuracies after "
                  "training; the chosen run is that seed's row above):", "",
                  md_table(["method", "lr", "training questions (%)", "paraphrases (%)",
                            "forgetting probes (%)"], rows)]
    return "\n".join(lines) + "\n"


def plot(res: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    names = ["Base", "Oracle", *res["runs"]]
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(SUITES)
    for j, suite in enumerate(SUITES):
        means, errs = [], []
        for name in names:
            if name == "Base":
                m, sd = res["base"].get(suite, 0.0), 0.0
            elif name == "Oracle":
                m, sd = res["oracle"].get(suite, 0.0), 0.0
            else:
                m, sd = mean_std([r[suite] for r in res["runs"][name]])
            means.append(100 * m)
            errs.append(100 * sd)
        xs = [i + (j - 1) * width for i in range(len(names))]
        ax.bar(xs, means, width, yerr=errs, capsize=3, label=suite)
    ax.set_xticks(range(len(names)), [textwrap.fill(n, 16) for n in names], fontsize=8)
    ax.set_ylabel("strict accuracy (%)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(f"knowledge facts, {res['steps']} steps, {res['n_seeds']} seed(s)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=6, help="optimizer steps per job (recipe: 20)")
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--lr", action="append", default=[], metavar="ARM=VALUE")
    ap.add_argument("--tune", action="store_true", help="pick each arm's lr on the first seed")
    ap.add_argument("--tune-factors", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                    help="--tune tries each arm's lr times each of these")
    ap.add_argument("--merge", type=Path, metavar="JSON",
                    help="add these seeds to an earlier result of the same settings")
    args = ap.parse_args(argv)
    if args.quick:  # one step of the first seed given
        args.steps, args.seeds = 1, args.seeds[:1]
    earlier = None
    if args.merge:
        if args.tune:
            ap.error("--merge and --tune: the merged table keeps the earlier learning rates")
        try:
            earlier = json.loads(args.merge.read_text())
        except (OSError, ValueError) as exc:
            ap.error(f"--merge {args.merge}: cannot read a result JSON ({exc})")
    lrs = dict(DEFAULT_LR)
    for item in args.lr:
        arm, _, value = item.partition("=")
        if arm not in ARMS:
            ap.error(f"--lr {item}: unknown arm {arm!r}; arms: {', '.join(ARMS)}")
        lrs[arm] = float(value)
    common = [f"steps={args.steps}", f"threads={args.threads}"]
    if earlier is not None:
        planned = {"steps": args.steps, "lrs": lrs, "arms": args.arms, "seeds": args.seeds,
                   "precision": planned_precision()}
        try:
            check_mergeable(earlier, planned, args.merge)
        except ValueError as exc:
            ap.error(str(exc))
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.quick:
            common = ["steps=1", "batch_size=2", "max_new_tokens=4", "eval.max_new_tokens=4",
                      f"model={tiny_model_dir(work / 'tiny')}", f"threads={args.threads}"]
        start = loadavg()
        jobs, tuning = Jobs(common, work), None
        if args.tune:
            best, tuning = tune(jobs, args.arms, lrs, args.tune_factors, args.seeds[0])
            lrs.update(best)
        res = run_table(jobs, args.arms, args.seeds, lrs)
    res.update(lrs=lrs, seeds=args.seeds, n_seeds=len(args.seeds), steps=args.steps,
               tuning=tuning)
    if earlier is not None:
        res = merge(earlier, res)
    settings = (f"examples/knowledge.yaml (16 facts, 16 prompts/step, LoRA r=16, forward KL "
                f"for SDFT) with {args.steps} optimizer steps x 2 updates per batch for every "
                f"method; seeds {res['seeds']}"
                + (f" (seeds {earlier['seeds']} from {args.merge.name})" if earlier else "")
                + f"; {args.threads} torch threads, CPU."
                + (" Quick smoke run on a tiny random model: the numbers mean nothing."
                   if args.quick else ""))
    text = render(res, settings, (start, loadavg()))
    name = "knowledge_table_quick" if args.quick else "knowledge_table"
    publish(args.out_dir, name, text, res, lambda path: plot(res, path))


if __name__ == "__main__":
    main(sys.argv[1:])
