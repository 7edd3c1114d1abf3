"""Hardware utilization of the student forward+backward: achieved FLOP/s vs a large matmul's.

The phase measured is what `train_step` times as "student": the LoRA model's forward over
prompt+completion (logits for the completion positions only), the top-k-with-tail divergence to
precomputed teacher logits, and the backward. Inputs: ``--batch`` rows of ``--prompt`` +
``--completion`` random tokens. Median wall time over ``--reps`` runs after one warm-up.

FLOPs, two ways:
- **counted**: ``torch.utils.flop_counter.FlopCounterMode`` over one forward+backward — the
  matmul/attention FLOPs the kernels actually executed (frozen base weights get no weight
  gradient, so backward is ~1x forward for them, ~2x for LoRA).
- **6·P·N formulas** with N = batch·(prompt+completion) tokens: "6 x all params" (the usual
  full-fine-tuning estimate, which overstates LoRA work: no weight gradients for frozen
  weights) and "honest LoRA" = (4·P_frozen + 6·P_lora)·N + the output head over the
  completion positions only (4·V·d per kept position: forward and input gradient; the head is
  frozen) — attention's T² terms left out.
The fraction reported is counted FLOPs / time divided by the FLOP/s of one large float32
matmul (``--matmul`` square, same threads, same process, median of ``--reps``), the two timed
alternately (pass, matmul, pass, …): this machine's speed drifts by up to 2x between minutes
(a 2048³ matmul measured 179 and 90 GFLOP/s in two runs an hour apart, idle both times).

    .venv/bin/python benchmarks/utilization.py             # default model, 8 x (48 + 64) tokens
    .venv/bin/python benchmarks/utilization.py --batch 16 --completion 128
    .venv/bin/python benchmarks/utilization.py --quick     # CI smoke: tiny random model
Results: benchmarks/results/utilization{_quick}.md / .json / .png.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import (
    base_parser,
    default_model_path,
    header,
    loadavg,
    md_table,
    publish,
    pyplot,
    save_figure,
    tiny_model_dir,
)


def interleaved_medians(fns: list[Any], reps: int) -> list[float]:
    """Median wall seconds of each callable over `reps` rounds after one warm-up each; every
    round runs all of them once, so a slow spell of the (shared, virtual) machine hits each
    alike instead of whichever was measured during it."""
    for fn in fns:
        fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times, strict=True):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    return [statistics.median(ts) for ts in times]


def param_counts(model: Any) -> dict[str, int]:
    """Frozen and LoRA parameters inside the transformer body (Linear layers), the head's
    V·d, and every parameter (embedding counted once: it is tied to the head)."""
    import torch

    frozen = lora = 0
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and "lm_head" not in name:
            n = mod.weight.numel()
            if "lora_" in name:
                lora += n
            else:
                frozen += n
    head = model.get_output_embeddings().weight.numel()
    return {"frozen_linear": frozen, "lora": lora, "head": head,
            "all": sum(p.numel() for p in model.parameters())}


def measure(model_dir: str, batch: int, prompt: int, completion: int, reps: int,
            matmul: int, threads: int) -> dict[str, Any]:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from selfdistill.losses import per_token_divergence
    from selfdistill.models import attach_lora, load_model
    from selfdistill.teacher import build_batch, completion_logits

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    lm = load_model(model_dir, progress=False)
    model = attach_lora(lm.model, rank=16, alpha=32)
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = torch.randint(10, vocab, (batch, prompt + completion)).tolist()
    sb = build_batch([r[:prompt] for r in ids], [r[prompt:] for r in ids], 0)
    with torch.no_grad():
        teacher = completion_logits(model, sb).float() + torch.randn(batch, completion, vocab)

    def step() -> None:
        model.train()
        logits = completion_logits(model, sb).float()
        per_tok = per_token_divergence(logits, teacher, alpha=0.5, topk=100, add_tail=True)
        per_tok[sb.completion_mask].mean().backward()
        model.zero_grad(set_to_none=True)

    with FlopCounterMode(display=False) as counter:
        step()
    counted = counter.get_total_flops()
    a, b = torch.randn(matmul, matmul), torch.randn(matmul, matmul)
    seconds, mm_seconds = interleaved_medians([step, lambda: a @ b], reps)
    mm = 2 * matmul**3 / mm_seconds  # FLOP/s of one (n, n) @ (n, n) float32 matmul
    p = param_counts(model)
    d = model.get_output_embeddings().weight.shape[1]
    n_tok = batch * (prompt + completion)
    honest = (4 * p["frozen_linear"] + 6 * p["lora"]) * n_tok + 4 * vocab * d * batch * (
        completion + 1)
    return {"seconds": seconds, "counted_flops": counted, "matmul_flops_per_s": mm,
            "params": p, "tokens": n_tok, "honest_flops": honest,
            "six_p_n_flops": 6 * p["all"] * n_tok}


def render(r: dict[str, Any], settings: str, load: tuple[str, str]) -> str:
    mm = r["matmul_flops_per_s"]
    rows = []
    for name, flops in (("counted (FlopCounterMode)", r["counted_flops"]),
                        ("honest LoRA formula", r["honest_flops"]),
                        ("6 x all params x tokens", r["six_p_n_flops"])):
        rate = flops / r["seconds"]
        rows.append([name, f"{flops / 1e9:.1f}", f"{rate / 1e9:.1f}", f"{100 * rate / mm:.1f} %"])
    p = r["params"]
    lines = [header("Student forward+backward: hardware utilization", settings, *load),
             f"Parameters: {p['all'] / 1e6:.1f} M in all, {p['frozen_linear'] / 1e6:.1f} M frozen "
             f"in the body's linear layers, {p['lora'] / 1e6:.2f} M LoRA, head "
             f"{p['head'] / 1e6:.1f} M (tied to the embedding). {r['tokens']} tokens per pass; "
             f"median pass {r['seconds']:.3f} s; large matmul {mm / 1e9:.1f} GFLOP/s.", "",
             md_table(["FLOPs counted as", "GFLOP per pass", "achieved GFLOP/s",
                       "of matmul FLOP/s"], rows), "",
             "The counted row is the utilization figure; the formulas show how much a 6·P·N "
             "estimate overstates the work when only LoRA weights get gradients. Target: >= 60 %."]
    return "\n".join(lines) + "\n"


def plot(r: dict[str, Any], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    vals = [r["counted_flops"] / r["seconds"] / 1e9, r["matmul_flops_per_s"] / 1e9]
    ax.bar(["student fwd+bwd\n(counted FLOPs)", "large matmul"], vals,
           color=["tab:blue", "tab:gray"])
    ax.set_ylabel("GFLOP/s (float32)")
    ax.set_title(f"utilization {100 * vals[0] / vals[1]:.0f} % of matmul")
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = base_parser(__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=48, help="prompt tokens per row")
    ap.add_argument("--completion", type=int, default=64, help="completion tokens per row")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--matmul", type=int, default=2048, help="reference matmul size n")
    ap.add_argument("--model", help="model directory (default: the embedded default model)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            model = tiny_model_dir(Path(tmp) / "tiny")
            args.reps, args.matmul, args.batch, args.completion = 1, 256, 2, 8
        else:
            model = args.model or default_model_path()
        start = loadavg()
        r = measure(model, args.batch, args.prompt, args.completion, args.reps, args.matmul,
                    args.threads)
    settings = (f"Model `{Path(model).name}` + LoRA r=16 all-linear, float32, CPU, "
                f"{args.threads} torch threads; {args.batch} rows x ({args.prompt} prompt + "
                f"{args.completion} completion) tokens; top-k 100 + tail divergence; "
                f"{args.reps} timed passes after a warm-up; matmul n={args.matmul}.")
    text = render(r, settings, (start, loadavg()))
    name = "utilization_quick" if args.quick else "utilization"
    publish(args.out_dir, name, text, r, lambda path: plot(r, path))


if __name__ == "__main__":
    main(sys.argv[1:])
