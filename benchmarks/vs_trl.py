"""Speed and memory against TRL's SDFTTrainer: same model, data and settings, one invocation.

What runs (settings in ``trl_side.py``; the embedded default model, examples/knowledge):

1. **Same-loss check** (``same_loss.py``): both trainers' own loss code on one batch (same
   tokens, same teacher context); the losses, the LoRA gradients and the per-token divergences
   must agree to float tolerance before any time is compared.
2. **Timing**: ``--rounds`` rounds of A B (ours, TRL; the order alternates between rounds).
   Each side runs in its own fresh process (so its peak RSS is its own): load, ``--warmup``
   optimizer steps (not counted), then ``--steps`` timed optimizer steps. Reported per side:
   per-step wall time (median / min / max over all rounds), the phase split (generate / teacher
   / student forward+backward / optimizer / other), completion tokens per second, and peak
   resident memory (ru_maxrss of the process; also after loading). Ratios: TRL's median step
   time over ours (>1 = we are faster), and our peak RSS over TRL's.

Our side runs with the CLI's allocator setting (``selfdistill.allocator.keep_freed_memory``,
applied by ``selfdistill train``); TRL's with glibc's defaults unless
``--trl-keep-freed-memory``; ours_lean (a memory option) with glibc's defaults. Every side's
process bounds oneDNN's kernel caches as the CLI does (``bound_kernel_caches``: a process
setting, so TRL gets it too).

Both sides sample their own completions (different random streams), so the work per step
differs a little (completion lengths); tokens/s accounts for that.

    .venv/bin/python benchmarks/vs_trl.py                    # default: 2 rounds x 3 steps
    .venv/bin/python benchmarks/vs_trl.py --rounds 4 --steps 5
    .venv/bin/python benchmarks/vs_trl.py --micro-batch-size 2 --chunk-size 64   # + ours_lean
    .venv/bin/python benchmarks/vs_trl.py --precision bfloat16   # bf16 autocast, both sides
    .venv/bin/python benchmarks/vs_trl.py --precision bfloat16 --base-dtype bfloat16
    .venv/bin/python benchmarks/vs_trl.py --trl-keep-freed-memory  # TRL with our allocator too
    .venv/bin/python benchmarks/vs_trl.py --quick            # CI smoke: tiny random model
Results: benchmarks/results/vs_trl{suffix}.md / .json / .png.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from common import (
    MIB,
    ROOT,
    add_omp_option,
    base_parser,
    default_model_path,
    header,
    loadavg,
    md_table,
    omp_env,
    publish,
    pyplot,
    ratio,
    save_figure,
    spawn,
    summary,
    tiny_model_dir,
    worker_main,
)
from trl_side import Settings, run_side

PHASES = ("generate", "teacher", "student", "optimizer", "other")
SIDES = ("ours", "trl")  # plus "ours_lean" (micro-batches / chunked loss) when asked for


def side_settings(s: Settings, side: str, trl_keeps_freed_memory: bool = False) -> Settings:
    """Plain "ours" and TRL run without our memory options; "ours_lean" with them. "ours" runs
    with the CLI's allocator setting (``keep_freed_memory``, as ``selfdistill train`` does),
    "ours_lean" without it (``SELFDISTILL_MALLOC=system``: freed memory goes back to the
    system), TRL with it only when ``trl_keeps_freed_memory``. The same-loss check compares
    the two loss functions in float32 whatever ``--precision`` and ``--base-dtype``."""
    if side == "ours_lean":
        return replace(s, keep_freed_memory=False)
    if side == "check":
        s = replace(s, precision="float32", base_dtype="float32")
    keep = side == "ours" or (side == "trl" and trl_keeps_freed_memory)
    return replace(s, micro_batch_size=None, chunk_size=None, gradient_checkpointing=False,
                   keep_freed_memory=keep)


def measure(s: Settings, rounds: int, sides: list[str], env: dict[str, str],
            trl_keeps_freed_memory: bool = False) -> dict[str, Any]:
    """Alternating rounds (A B C / C B A / ...), one fresh process per side and round."""
    out: dict[str, Any] = {side: {"steps": [], "rss_peak": 0, "rss_loaded": 0, "errors": []}
                           for side in sides}
    for i in range(rounds):
        for side in sides if i % 2 == 0 else sides[::-1]:
            print(f"round {i + 1}/{rounds}: {side} (load {loadavg()})", file=sys.stderr,
                  flush=True)
            side_s = side_settings(s, side, trl_keeps_freed_memory)
            res = spawn(__file__, {"side": side, **asdict(side_s)}, env=env)
            acc = out[side]
            if "error" in res:
                acc["errors"].append(res["error"])
                continue
            acc["steps"] += res["steps"]
            acc["rss_peak"] = max(acc["rss_peak"], res["rss_peak"])
            acc["rss_loaded"] = max(acc["rss_loaded"], res["rss_loaded"])
    return out


def side_stats(acc: dict[str, Any]) -> dict[str, Any]:
    steps = acc["steps"]
    secs = [st["seconds"] for st in steps]
    tokens = sum(st["tokens"] for st in steps)
    return {
        "step": summary(secs),
        "phases": {p: statistics.median([st["phases"].get(p, 0.0) for st in steps])
                   if steps else float("nan") for p in PHASES},
        "tokens_per_s": tokens / sum(secs) if secs else float("nan"),
        "tokens_per_step": tokens / len(steps) if steps else float("nan"),
        "rss_peak_mib": acc["rss_peak"] / MIB,
        "rss_loaded_mib": acc["rss_loaded"] / MIB,
    }


def render(s: Settings, rounds: int, check: dict[str, Any], stats: dict[str, Any],
           errors: dict[str, list[str]], load: tuple[str, str], omp: str,
           trl_keep: bool = False, kernel_caches: int | None = None) -> str:
    eq, rg = check.get("equal_lengths", {}), check.get("ragged", {})
    trl_alloc = "the same setting as ours" if trl_keep else "glibc's defaults"
    settings = (
        f"Model `{Path(s.model).name}`, {s.batch_size} prompts/step x 1 completion, max "
        f"{s.max_new_tokens} new tokens, temperature 1, LoRA r={s.lora_rank} alpha="
        f"{s.lora_alpha:g} all-linear, top-k {s.topk} + tail, alpha {s.alpha}, frozen-base "
        f"teacher, lr {s.learning_rate:g} constant, seed {s.seed}, {s.threads} torch threads, "
        f"CPU, {'bf16 autocast on both sides' if s.precision == 'bfloat16' else 'float32'}, "
        f"base weights {s.base_dtype} on both sides, OpenMP wait policy {omp}. Both sides "
        "load the model with selfdistill.models.load_model, so both run SDPA in the precision "
        "selfdistill.attention picks (float32 for decode steps and short sequences under CPU "
        "bf16 autocast; TRL as shipped would run bf16 SDPA there). ours: "
        f"{'LoRA-folded' if s.fold_lora else 'PEFT-layer'}, "
        f"{'oneDNN-packed' if s.pack_weights else 'unpacked'} decoding (rollout.fold_lora, "
        "rollout.pack_weights), Llama decode loop (rollout.decode_loop), loss.chunk_size "
        "at its default. Allocator: ours with the CLI's keep_freed_memory "
        "(selfdistill/allocator.py, as `selfdistill train` runs), ours_lean with glibc's "
        "defaults (SELFDISTILL_MALLOC=system), TRL with "
        f"{trl_alloc}. Every side's process bounds oneDNN's kernel caches "
        + ("as the CLI does (selfdistill.allocator.bound_kernel_caches). " if kernel_caches is None
           else f"at {kernel_caches} entries each (--kernel-cache-capacity). ")
        + "ours_lean (when present): micro_batch_size="
        f"{s.micro_batch_size}, chunk_size={s.chunk_size}, gradient_checkpointing="
        f"{s.gradient_checkpointing}. {rounds} round(s) (A B C, C B A, ...), each side a fresh "
        "process: "
        f"{s.warmup} warm-up + {s.steps} timed optimizer steps per round.")
    lines = [header("selfdistill vs TRL SDFTTrainer: speed and memory", settings, *load)]
    lines += ["## Same loss on the same batch", ""]
    if "error" in check:
        lines += [f"Check failed to run: {check['error']}", ""]
    else:
        lines += [md_table(
            ["batch", "tokens", "TRL loss", "our loss", "max |Δ per-token div|",
             "max |Δ LoRA grad| / max |grad|"],
            [[name, d["tokens"], f"{d['trl_loss']:.7g}", f"{d['our_loss']:.7g}",
              f"{d['per_token_max_abs_diff']:.2e}",
              f"{d['grad_max_abs_diff']:.2e} / {d['grad_max_abs']:.2e}"]
             for name, d in (("equal lengths", eq), ("ragged", rg)) if d]), ""]
        if rg:
            lines += [f"Ragged batch (row lengths {rg['row_lengths']}): TRL's reduction (mean "
                      f"of per-sequence means) gives {rg['trl_loss']:.7g}; our per-token values "
                      f"reduced that way give {rg['ours_trl_reduction']:.7g}; our token mean "
                      f"(what we train on) is {rg['our_loss']:.7g}; the gradients differ "
                      "accordingly (last column of the ragged row).", ""]
    lines += ["Semantic differences that remain: (1) reduction — TRL averages tokens within "
              "each sequence, then sequences; we average all tokens of the batch (equal when "
              "rows have equal length; otherwise short answers weigh more in TRL); (2) TRL's "
              "tail bucket is log(1 − Σ top-k), ours sums the rest of the vocabulary (float32 "
              "rounding only); (3) TRL divides logits by the sampling temperature (identity at "
              "temperature 1, used here); (4) each side samples its own completions.", ""]
    sides = list(stats)
    if not any(stats[side]["step"]["n"] for side in sides):
        return "\n".join(lines) + "\n"
    lines += ["## Speed and memory", ""]
    rows = []
    for side in sides:
        st = stats[side]
        rows.append([side, f"{st['step']['median']:.2f}", f"{st['step']['min']:.2f}",
                     f"{st['step']['max']:.2f}", st["step"]["n"],
                     *(f"{st['phases'][p]:.2f}" for p in PHASES),
                     f"{st['tokens_per_step']:.0f}", f"{st['tokens_per_s']:.1f}",
                     f"{st['rss_loaded_mib']:.0f}", f"{st['rss_peak_mib']:.0f}"])
    lines += [md_table(["side", "step median (s)", "min", "max", "steps",
                        *(f"{p} (s)" for p in PHASES), "tokens/step", "tokens/s",
                        "RSS loaded (MiB)", "peak RSS (MiB)"], rows), ""]
    t = stats.get("trl")
    for side in (x for x in sides if x != "trl" and t is not None):
        o = stats[side]
        lines += [f"**{side}: {ratio(t['step']['median'], o['step']['median'])}x TRL's "
                  f"steps/s (median step time; min: {ratio(t['step']['min'], o['step']['min'])}"
                  f"x), {ratio(o['tokens_per_s'], t['tokens_per_s'])}x its tokens/s; peak RSS "
                  f"{ratio(o['rss_peak_mib'], t['rss_peak_mib'])}x TRL's.**", ""]
    lines += ["Targets: >= 2x TRL's steps/s, <= 0.75x its peak memory.", ""]
    for side, errs in errors.items():
        lines += [f"{side} failed in a round: {e[-400:]}" for e in errs]
    return "\n".join(lines) + "\n"


def plot(stats: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    sides = list(stats)
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(10, 4))
    bottom = [0.0] * len(sides)
    for p in PHASES:
        vals = [stats[side]["phases"][p] for side in sides]
        ax_t.bar(sides, vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax_t.set_ylabel("seconds per optimizer step (median per phase)")
    ax_t.legend(fontsize=8)
    ax_m.bar(sides, [stats[s]["rss_peak_mib"] for s in sides],
             color=["tab:gray" if s == "trl" else "tab:blue" for s in sides])
    ax_m.set_ylabel("peak RSS (MiB)")
    fig.suptitle("selfdistill vs TRL SDFTTrainer (same settings)")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if worker_main(argv, run_side):
        return
    ap = base_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=2, help="A B rounds (default 2)")
    ap.add_argument("--steps", type=int, default=3, help="timed optimizer steps per round")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps per process")
    ap.add_argument("--model", help="model directory (default: the embedded default model)")
    ap.add_argument("--micro-batch-size", type=int, help="ours: student fwd+bwd micro-batch")
    ap.add_argument("--chunk-size", type=int, help="ours: chunked divergence rows")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="ours_lean: recompute activations in the backward")
    ap.add_argument("--no-fold", action="store_true",
                    help="ours: decode through PEFT's adapter layers (rollout.fold_lora=false)")
    ap.add_argument("--no-pack", action="store_true",
                    help="ours: decode with PyTorch's default CPU matmul (rollout.pack_weights="
                    "false)")
    ap.add_argument("--check-only", action="store_true", help="only the same-loss check")
    ap.add_argument("--no-check", action="store_true", help="skip the same-loss check")
    ap.add_argument("--sides", nargs="+", choices=[*SIDES, "ours_lean"],
                    help="run only these sides (e.g. re-measure one side's memory)")
    ap.add_argument("--precision", choices=("float32", "bfloat16"), default="float32",
                    help="both sides: bfloat16 = autocast (ours precision=bfloat16, TRL bf16=True)")
    ap.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="both sides: dtype of the frozen base weights (LoRA stays float32)")
    ap.add_argument("--kernel-cache-capacity", type=int,
                    help="every side: oneDNN's kernel cache capacities (default: the CLI's bound, "
                         "selfdistill.allocator.bound_kernel_caches; oneDNN's own default is 1024)")
    ap.add_argument("--trl-keep-freed-memory", action="store_true",
                    help="TRL's process too runs with our CLI's allocator setting "
                    "(selfdistill.allocator.keep_freed_memory; ours always does)")
    add_omp_option(ap, "default")
    args = ap.parse_args(argv)
    tmp = tempfile.TemporaryDirectory()
    if args.quick:
        model = tiny_model_dir(Path(tmp.name) / "tiny")
        args.rounds, args.steps, args.warmup = 1, 1, 0
    else:
        model = args.model or default_model_path()
    s = Settings(model=model, train_data=str(ROOT / "examples/knowledge/train.jsonl"),
                 threads=args.threads, steps=args.steps, warmup=args.warmup,
                 micro_batch_size=args.micro_batch_size, chunk_size=args.chunk_size,
                 gradient_checkpointing=args.gradient_checkpointing, fold_lora=not args.no_fold,
                 pack_weights=not args.no_pack,
                 max_new_tokens=16 if args.quick else 64, precision=args.precision,
                 base_dtype=args.base_dtype)
    lean = args.micro_batch_size or args.chunk_size or args.gradient_checkpointing
    sides = [*SIDES, "ours_lean"] if lean else [*SIDES]
    sides = args.sides or sides
    start = loadavg()
    check = {"error": "skipped (--no-check)"} if args.no_check else spawn(
        __file__, {"side": "check", **asdict(side_settings(s, "check"))})
    print(f"same-loss check: {check}", file=sys.stderr, flush=True)
    if args.check_only:
        acc = {side: {"steps": [], "rss_peak": 0, "rss_loaded": 0, "errors": []}
               for side in sides}
    else:
        caches = {} if args.kernel_cache_capacity is None else {
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(args.kernel_cache_capacity),
            "LRU_CACHE_CAPACITY": str(args.kernel_cache_capacity)}
        acc = measure(s, args.rounds, sides, {**omp_env(args.omp_wait_policy), **caches},
                      args.trl_keep_freed_memory)
    stats = {side: side_stats(acc[side]) for side in sides}
    suffix = "_quick" if args.quick else ("_check" if args.check_only else "")
    if lean:
        suffix += f"_mb{args.micro_batch_size}_chunk{args.chunk_size}"
        suffix += "_ckpt" if args.gradient_checkpointing else ""
    suffix += "_nofold" if args.no_fold else ""
    suffix += "_nopack" if args.no_pack else ""
    suffix += "_trl-keep" if args.trl_keep_freed_memory else ""
    suffix += "" if args.kernel_cache_capacity is None else f"_kcache{args.kernel_cache_capacity}"
    suffix += "_bf16" if args.precision == "bfloat16" else ""
    suffix += "_base-bf16" if args.base_dtype == "bfloat16" else ""
    suffix += "" if args.omp_wait_policy == "default" else f"_omp-{args.omp_wait_policy}"
    if args.sides:
        suffix += "_" + "_".join(args.sides)
    text = render(s, args.rounds, check, stats, {k: v["errors"] for k, v in acc.items()},
                  (start, loadavg()), args.omp_wait_policy, args.trl_keep_freed_memory,
                  args.kernel_cache_capacity)
    publish(args.out_dir, f"vs_trl{suffix}", text,
            {"settings": asdict(s), "check": check, "stats": stats, "raw": acc},
            lambda path: plot(stats, path))
    tmp.cleanup()


if __name__ == "__main__":
    main()
