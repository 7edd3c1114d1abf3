"""Time and peak extra memory of `per_token_divergence` forward+backward: plain vs chunked.

What is measured, per configuration (estimator ∈ {full, top-k 100 + tail}, path ∈ {plain,
chunked, chunked+overwrite}), on CPU in float32 with B=4, V=49152 and T=1024 (``--long``:
T=4096). ``chunked+overwrite`` is ``overwrite_student=True``: the backward writes the gradient
over the student logits (what the trainer does with its row-selected copy of them) instead of
allocating it:

- **time**: wall-clock seconds of ``per_token_divergence(...).sum().backward()``. ``--rounds``
  rounds; in each, every configuration runs once in a fresh process (one warm-up run, then one
  timed run), so the configurations are interleaved in time. Median and minimum are reported.
- **peak extra memory**: each configuration runs in its own fresh subprocess. After the inputs
  (student logits with ``requires_grad``, teacher logits; generated in place, no temporaries)
  are allocated and touched, the current resident set size (/proc/self/statm) is the baseline;
  after the warm-up and timed runs, the peak resident set size
  ``resource.getrusage(RUSAGE_SELF).ru_maxrss`` is read. The difference is the most memory the
  forward+backward ever needed on top of its inputs, as the operating system saw it (every page
  torch touched, allocator slack included; nothing is estimated). It includes the (B, T, V)
  gradient of the student logits itself (B·T·V·4 bytes), which the plain and chunked paths
  allocate, so the chunked path cannot go below that floor (the "above the gradient" column
  compares what each needs beyond it); chunked+overwrite stores it in the logits' storage.
- **time ratios** compare processes that ran minutes apart on a shared machine, so they carry
  the noise of whatever else ran meanwhile (the load average at start and end is recorded); the
  interleaving spreads that noise evenly, and the minimum is the least disturbed run.

OpenMP wait policy: workers run with ``OMP_WAIT_POLICY=PASSIVE`` unless ``--omp-wait-policy
default``. On a machine whose cores are shared with other busy processes, libgomp's default
spin-waiting makes every parallel kernel wait for a descheduled peer thread; the chunked path
launches ~B·T/chunk times more (smaller) kernels than the plain path, so it is penalized by the
sharing, not by its arithmetic (measured here, T=1024, top-k, 2 threads, load average ~3.7:
chunked 5.97 s vs plain 3.58 s with libgomp's default, 1.47 s vs 3.22 s with PASSIVE; see
results/loss_kernels_omp-default.md and results/loss_kernels.md). The header records the
policy used.

When the plain path cannot fit in this machine's available memory (``--long``: it saves several
(B·T, V) float32 intermediates), it is not run: a probe at T/8 is measured the same way and its
extra memory is scaled linearly in T (every intermediate is proportional to B·T·V); when inputs
plus that estimate exceed ``--mem-fraction`` of MemAvailable, the row is marked "extrapolated"
and gets no time.

Results: a Markdown table on stdout and in ``benchmarks/results/loss_kernels{suffix}.md``, and a
bar plot ``loss_kernels{suffix}.png`` (suffix "" by default, "_long", "_quick"; plus
"_omp-<policy>" for a non-default ``--omp-wait-policy``).

    .venv/bin/python benchmarks/loss_kernels.py            # T=1024
    .venv/bin/python benchmarks/loss_kernels.py --long     # T=4096
    .venv/bin/python benchmarks/loss_kernels.py --quick    # CI smoke, < 20 s
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import (
    MIB,
    RESULTS,
    ROOT,
    add_omp_option,
    available_bytes,
    cpu_name,
    current_rss_bytes,
    loadavg,
    omp_env,
    peak_rss_bytes,
    ratio,
)

ESTIMATORS = {"full": None, "topk100+tail": 100}
PATHS = ("plain", "chunked", "chunked+overwrite")


def run_worker(cfg: dict) -> dict:
    """One configuration in this (fresh) process; returns times and the peak extra RSS."""
    sys.path.insert(0, str(ROOT))
    import torch

    from selfdistill.losses import per_token_divergence

    torch.set_num_threads(cfg["threads"])
    torch.manual_seed(0)
    shape = (cfg["batch"], cfg["seq"], cfg["vocab"])
    student = torch.randn(shape).mul_(3.0).requires_grad_(True)
    teacher = torch.randn(shape).mul_(3.0)
    baseline = current_rss_bytes()
    kwargs = {"alpha": cfg["alpha"], "topk": cfg["topk"], "add_tail": True}
    if cfg["path"] != "plain":
        kwargs["chunk_size"] = cfg["chunk_size"]
        kwargs["overwrite_student"] = cfg["path"] == "chunked+overwrite"
    times = []
    for i in range(cfg["repeats"] + 1):
        if i > 0:  # the overwrite path left gradients in the logits: fresh values, same memory
            with torch.no_grad():
                student.normal_().mul_(3.0)
        start = time.perf_counter()
        # autograd.grad hands the gradient back as computed (no .grad accumulation copy)
        (grad,) = torch.autograd.grad(per_token_divergence(student, teacher, **kwargs).sum(),
                                      student)
        elapsed = time.perf_counter() - start
        del grad
        if i > 0:  # run 0 is the warm-up
            times.append(elapsed)
    return {"times": times, "extra_bytes": peak_rss_bytes() - baseline}


def _spawn(cfg: dict) -> dict:
    env = {**os.environ, **omp_env(cfg["omp_wait_policy"])}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    if proc.returncode != 0:
        return {"error": f"rc={proc.returncode} {proc.stderr.strip()[-300:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def too_big(cfg: dict) -> dict | None:
    """For the plain path at T >= 2048: None when it fits in available memory, else a result
    whose memory is extrapolated linearly in T from a T/8 probe (measured the same way)."""
    if cfg["path"] != "plain" or cfg["seq"] < 2048:
        return None
    probed = _spawn({**cfg, "seq": cfg["seq"] // 8, "repeats": 1})
    if "error" in probed:
        return probed
    need = probed["extra_bytes"] * 8
    inputs = 2 * cfg["batch"] * cfg["seq"] * cfg["vocab"] * 4
    if inputs + need > cfg["mem_fraction"] * available_bytes():
        return {"times": [], "extra_bytes": need, "extrapolated": True}
    return None


def measure_round_robin(cfgs: list[dict], rounds: int) -> list[dict]:
    """``rounds`` rounds; in each, every configuration runs once in a fresh process (warm-up +
    one timed run). Interleaving spreads the load of other processes on a shared machine evenly
    over the configurations instead of penalizing whichever ran during a busy minute.
    Memory: the largest peak extra RSS over the rounds."""
    results = [too_big(cfg) or {"times": [], "extra_bytes": 0} for cfg in cfgs]
    for i in range(rounds):
        for cfg, res in zip(cfgs, results, strict=True):
            if "error" in res or res.get("extrapolated"):
                continue
            name = f"{cfg['estimator']} / {cfg['path']}"
            print(f"round {i + 1}/{rounds}: {name}", file=sys.stderr, flush=True)
            one = _spawn({**cfg, "repeats": 1})
            if "error" in one:
                res.clear()
                res.update(one)
                continue
            res["times"] += one["times"]
            res["extra_bytes"] = max(res["extra_bytes"], one["extra_bytes"])
    return [
        {"estimator": c["estimator"], "path": c["path"], **r}
        for c, r in zip(cfgs, results, strict=True)
    ]


def render(settings: dict, rows: list[dict]) -> str:
    grad_mib = settings["batch"] * settings["seq"] * settings["vocab"] * 4 / MIB
    lines = [
        f"# per_token_divergence forward+backward, {settings['label']}",
        "",
        f"B={settings['batch']}, T={settings['seq']}, V={settings['vocab']}, float32, CPU "
        f"({settings['cpu']}), {settings['threads']} torch threads "
        f"(OMP_WAIT_POLICY {settings['omp_wait_policy']}), alpha={settings['alpha']}, "
        f"chunk_size={settings['chunk_size']} rows. {settings['rounds']} rounds, each running "
        f"every configuration once in a fresh process (1 warm-up + 1 timed run); load average "
        f"at start {settings['loadavg']}, at end {settings.get('loadavg_end', '?')} "
        f"(shared 2-core machine: other jobs compete for the cores, so medians are noisy; the "
        f"minimum is the least disturbed run).",
        f"Peak extra memory = peak RSS minus RSS after allocating inputs; for plain and "
        f"chunked it includes the {grad_mib:.0f} MiB student-logit gradient they allocate "
        f"(chunked+overwrite writes it over the student logits).",
        "",
        "| estimator | path | time median (s) | time min (s) | peak extra (MiB) "
        "| chunked/plain time (median, min) | chunked/plain memory "
        "| chunked/plain memory above the gradient |",
        "|---|---|---|---|---|---|---|---|",
    ]
    by_key = {(r["estimator"], r["path"]): r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['estimator']} | {r['path']} | failed: {r['error']} | | | | | |")
            continue
        med = statistics.median(r["times"]) if r["times"] else None
        low = min(r["times"]) if r["times"] else None
        mem = r["extra_bytes"] / MIB
        mem_txt = f"~{mem:.0f} (extrapolated, not run)" if r.get("extrapolated") else f"{mem:.0f}"
        t_ratio = m_ratio = g_ratio = ""
        plain = by_key.get((r["estimator"], "plain"), {"error": "missing"})
        if r["path"] != "plain" and "error" not in plain:
            p_med = statistics.median(plain["times"]) if plain["times"] else None
            p_low = min(plain["times"]) if plain["times"] else None
            t_ratio = f"{ratio(med, p_med)}, {ratio(low, p_low)}"
            m_ratio = ratio(r["extra_bytes"], plain["extra_bytes"])
            # what each path needs beyond the (B, T, V) gradient any implementation returns
            g_ratio = "n/a (no gradient tensor)" if r["path"] != "chunked" else ratio(
                max(r["extra_bytes"] - grad_mib * MIB, 0.0) or 1e-9,
                plain["extra_bytes"] - grad_mib * MIB)
            if plain.get("extrapolated"):
                m_ratio += " (vs extrapolated)"
        med_txt = "n/a" if med is None else f"{med:.3g}"
        low_txt = "n/a" if low is None else f"{low:.3g}"
        lines.append(
            f"| {r['estimator']} | {r['path']} | {med_txt} | {low_txt} | {mem_txt} | {t_ratio} "
            f"| {m_ratio} | {g_ratio} |"
        )
    return "\n".join(lines) + "\n"


def plot(settings: dict, rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    labels = [f"{r['estimator']}\n{r['path']}" for r in ok]
    colors = [{"plain": "tab:blue", "chunked": "tab:orange"}.get(r["path"], "tab:green")
              for r in ok]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    times = [statistics.median(r["times"]) if r["times"] else 0.0 for r in ok]
    ax_t.bar(labels, times, color=colors)
    ax_t.set_ylabel("forward+backward time, median (s)")
    ax_m.bar(labels, [r["extra_bytes"] / MIB for r in ok], color=colors)
    for i, r in enumerate(ok):
        if r.get("extrapolated"):
            ax_m.patches[i].set_hatch("//")
            ax_t.text(i, 0, "not run", ha="center", va="bottom", fontsize=8)
    ax_m.set_ylabel("peak extra RSS (MiB)")
    fig.suptitle(f"per_token_divergence, {settings['label']} (hatched: extrapolated)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="tiny CI smoke setting (< 20 s)")
    mode.add_argument("--long", action="store_true", help="T=4096 instead of 1024")
    parser.add_argument(
        "--rounds", type=int, default=None, help="timed runs per configuration (default 5; 1 quick)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument(
        "--chunk-size", type=int, default=None, help="rows per chunk (default 128; 32 quick)"
    )
    parser.add_argument("--alpha", type=float, default=0.5, help="divergence alpha")
    parser.add_argument(
        "--mem-fraction",
        type=float,
        default=0.7,
        help="run a plain configuration only if inputs + extrapolated extra memory stay below "
        "this fraction of MemAvailable (the machine is shared)",
    )
    add_omp_option(parser, "passive")
    parser.add_argument("--out-dir", type=Path, default=RESULTS, help="where the table and plot go")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(json.loads(args.worker))))
        return

    if args.quick:
        label, suffix, batch, seq, vocab = "quick smoke", "_quick", 2, 64, 4096
    elif args.long:
        label, suffix, batch, seq, vocab = "long (T=4096)", "_long", 4, 4096, 49152
    else:
        label, suffix, batch, seq, vocab = "default (T=1024)", "", 4, 1024, 49152
    settings = {
        "label": label,
        "batch": batch,
        "seq": seq,
        "vocab": vocab,
        "threads": args.threads,
        "alpha": args.alpha,
        "chunk_size": args.chunk_size or (32 if args.quick else 128),
        "omp_wait_policy": args.omp_wait_policy,
        "mem_fraction": args.mem_fraction,
        "rounds": args.rounds or (1 if args.quick else 5),
        "cpu": cpu_name(),
        "loadavg": loadavg(),
    }
    keys = (
        "batch",
        "seq",
        "vocab",
        "threads",
        "alpha",
        "chunk_size",
        "omp_wait_policy",
        "mem_fraction",
    )
    cfgs = [
        {**{k: settings[k] for k in keys}, "estimator": name, "topk": topk, "path": path}
        for name, topk in ESTIMATORS.items()
        for path in PATHS
    ]
    rows = measure_round_robin(cfgs, settings["rounds"])
    settings["loadavg_end"] = loadavg()
    table = render(settings, rows)
    print(table)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.omp_wait_policy != "passive":
        suffix += f"_omp-{args.omp_wait_policy}"
    (args.out_dir / f"loss_kernels{suffix}.md").write_text(table)
    plot(settings, rows, args.out_dir / f"loss_kernels{suffix}.png")


if __name__ == "__main__":
    main()
