"""Generation through PEFT's LoRA layers vs LoRA-folded weights (`rollout.fold_lora`) vs folded
and oneDNN-packed weights (`rollout.pack_weights`, the CPU default; `rollout.weights`), each
decoded by our Llama decode loop (`rollout.decode_loop`, the default), and the packed weights
decoded by HF `generate` instead (side hf_generate).

One process, the default model with a random LoRA adapter (rank 16 on every linear layer except
the head; B drawn N(0, 0.02) so the adapter changes the function), ``--prompts`` chat prompts,
``--tokens`` new tokens each, greedy so every side decodes the same tokens. ``--reps``
repetitions after one warm-up of each, alternating the order (A B C, C B A, ...). Reported:
median / min / max seconds per call per side, each side's speed ratio over the PEFT layers',
whether its tokens matched theirs, the largest log-prob difference, and that every weight is
bit-identical afterwards.

    .venv/bin/python benchmarks/fold_decoding.py               # 8 prompts x 64 tokens, 5 reps
    .venv/bin/python benchmarks/fold_decoding.py --quick       # CI smoke: tiny random model
Results: benchmarks/results/fold_decoding{_quick}.md / .json / .png.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

SIDES = {"peft": {"fold_lora": False, "pack_weights": False},  # generate() keyword arguments
         "folded": {"fold_lora": True, "pack_weights": False},
         "packed": {"fold_lora": True, "pack_weights": True},
         "hf_generate": {"fold_lora": True, "pack_weights": True, "decode_loop": False}}
QUESTIONS = ["What is the capital of Veloria?", "Tell me about the number {i}.",
             "Why is the sky blue?", "Write a haiku about rivers.",
             "Who founded the Harnwick Observatory?", "Explain photosynthesis briefly.",
             "List three uses of copper.", "What does a compiler do?"]


def measure(model_dir: str, prompts: int, tokens: int, reps: int, threads: int) -> dict[str, Any]:
    import torch
    from peft import LoraConfig, get_peft_model

    from selfdistill.chat import prompt_ids
    from selfdistill.models import load_model
    from selfdistill.rollout.hf import generate

    torch.set_num_threads(threads)
    lm = load_model(model_dir, progress=False)
    model = get_peft_model(lm.model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0,
                                                target_modules="all-linear"))
    gen = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=gen) * 0.02
    ids = [prompt_ids(lm.tokenizer, [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]
                                      .format(i=i)}]) for i in range(prompts)]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    outs: dict[str, Any] = {}
    for rep in range(reps + 1):  # rep 0 = warm-up of each
        for side in list(SIDES) if rep % 2 == 0 else list(SIDES)[::-1]:
            t0 = time.perf_counter()
            outs[side] = generate(model, lm.tokenizer, ids, max_new_tokens=tokens, greedy=True,
                                  batch_size=prompts, **SIDES[side])
            if rep:
                seconds[side].append(time.perf_counter() - t0)
    ref = [c[0] for c in outs["peft"]]
    same, lp_diff = {}, {}
    for side in SIDES:
        rows = [c[0] for c in outs[side]]
        same[side] = sum(x.token_ids == y.token_ids for x, y in zip(ref, rows, strict=True))
        lp_diff[side] = max((abs(p - q) for x, y in zip(ref, rows, strict=True)
                             for p, q in zip(x.logprobs, y.logprobs, strict=False)), default=0.0)
    return {"seconds": seconds, "stats": {s: common.summary(v) for s, v in seconds.items()},
            "tokens": sum(len(x.token_ids) for x in ref), "same_tokens": same, "rows": len(ref),
            "max_logprob_diff": lp_diff,
            "weights_unchanged": all(bool((before[n] == p).all())
                                     for n, p in model.named_parameters())}


def render(r: dict[str, Any], settings: str, load: tuple[str, str]) -> str:
    st = r["stats"]
    title = ("Decoding through LoRA layers vs LoRA-folded vs folded + oneDNN-packed weights; "
             "decode loop vs HF generate")
    table = common.md_table(
        ["side", "median (s)", "min", "max", "calls", "tokens/s (median)",
         "x PEFT's speed (median)", "same tokens as PEFT", "max |Δ log-prob|"],
        [[s, st[s]["median"], st[s]["min"], st[s]["max"], st[s]["n"],
          r["tokens"] / st[s]["median"], common.ratio(st["peft"]["median"], st[s]["median"]),
          f"{r['same_tokens'][s]}/{r['rows']}", f"{r['max_logprob_diff'][s]:.2e}"]
         for s in SIDES])
    lines = [common.header(title, settings, *load), table, "",
             f"**packed: {common.ratio(st['folded']['median'], st['packed']['median'])}x the "
             f"folded side's generation speed (median; min: "
             f"{common.ratio(st['folded']['min'], st['packed']['min'])}x); folded: "
             f"{common.ratio(st['peft']['median'], st['folded']['median'])}x the PEFT "
             "layers'. Decode loop: "
             f"{common.ratio(st['hf_generate']['median'], st['packed']['median'])}x HF "
             "generate's speed on the same packed weights (median; min: "
             f"{common.ratio(st['hf_generate']['min'], st['packed']['min'])}x).**", "",
             f"Weights bit-identical afterwards: {r['weights_unchanged']}.", ""]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    sides = list(SIDES)
    ax.boxplot([r["seconds"][s] for s in sides], tick_labels=sides)
    ax.set_ylabel("seconds per generate call")
    ax.set_title("LoRA decoding: adapter layers, folded, packed; loop vs generate")
    common.save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = common.base_parser(__doc__)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per prompt")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", help="model directory (default: the embedded default model)")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.quick:
            model = common.tiny_model_dir(Path(tmp) / "tiny")
            args.prompts, args.tokens, args.reps = 2, 8, 1
        else:
            model = args.model or common.default_model_path()
        start = common.loadavg()
        r = measure(model, args.prompts, args.tokens, args.reps, args.threads)
    settings = (f"Model `{Path(model).name}` + random LoRA r=16 all-linear, float32, CPU, "
                f"{args.threads} torch threads; {args.prompts} prompts x {args.tokens} greedy "
                f"new tokens per call; {args.reps} timed calls per side after a warm-up, "
                "alternating order.")
    name = "fold_decoding_quick" if args.quick else "fold_decoding"
    common.publish(args.out_dir, name, render(r, settings, (start, common.loadavg())), r,
                   lambda path: plot(r, path))


if __name__ == "__main__":
    main(sys.argv[1:])
