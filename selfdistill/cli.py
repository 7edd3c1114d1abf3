"""The `selfdistill` command: one entry point, one sub-command per job.

Errors a user can cause (`selfdistill.errors.UserError`) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

from selfdistill.allocator import bound_kernel_caches, keep_freed_memory
from selfdistill.errors import UserError

# Sub-commands that live beside their feature: module path → it defines add_subcommand(subparsers).
_PLUGINS = (
    "selfdistill.train.cli",
    "selfdistill.envs.cli",
    "selfdistill.store.cli",
    "selfdistill.evals.compare",
    "selfdistill.registry.cli",
    "selfdistill.serve.cli",
)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="Hugging Face model directory or hub id (default: the embedded "
                        "SmolLM2-135M-Instruct)")
    p.add_argument("--adapter", default=None, help="PEFT adapter directory to apply")
    p.add_argument("--max-new-tokens", type=int, default=64, help="generation budget (tokens)")


def _cmd_generate(args: argparse.Namespace) -> int:
    from selfdistill.chat import prompt_ids, to_messages
    from selfdistill.models import load_model
    from selfdistill.rollout import generate

    meta: dict[str, Any] = {"adapter": args.adapter}
    if args.user or args.workspace or args.registry:
        if args.adapter:
            raise UserError("--adapter and --user/--workspace/--registry both choose the adapter: "
                            "give one")
        from selfdistill.registry import Registry

        with Registry(args.registry) as reg:  # user → workspace → global → base
            lm, res = reg.load_resolved(args.user, args.workspace, model=args.model,
                                        progress=not args.quiet)
        meta = {"adapter": res.version, "resolution": res.as_dict()}
    else:
        lm = load_model(args.model, adapter=args.adapter, progress=not args.quiet)
    messages = to_messages(args.prompt)
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    ids = prompt_ids(lm.tokenizer, messages)
    [[c]] = generate(lm.model, lm.tokenizer, [ids], greedy=args.temperature == 0,
                     temperature=args.temperature or 1.0, max_new_tokens=args.max_new_tokens)
    if args.json:
        print_json({"text": c.text, "completion_tokens": len(c.token_ids), **meta})
    else:
        print(c.text)
        if "resolution" in meta:
            r = meta["resolution"]
            print(f"[adapter: {r['version'] or 'base model'}"
                  f"{' of ' + r['scope'] if r['scope'] else ''}; tried {' → '.join(r['order'])}]",
                  file=sys.stderr)
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from selfdistill.data import load_rows
    from selfdistill.evals import evaluate
    from selfdistill.models import load_model

    rows = load_rows(args.data, require=("prompt", "answer"), purpose="evaluation")
    lm = load_model(args.model, adapter=args.adapter, progress=not args.quiet)
    report = evaluate(lm.model, lm.tokenizer, rows, max_new_tokens=args.max_new_tokens,
                      batch_size=args.batch_size, progress=not args.quiet)
    if not args.quiet:
        for item in report.items:
            mark = "✓" if item.correct else "✗"
            q = item.prompt[-1]["content"].replace("\n", " ")[:48]
            a = item.completion.replace("\n", " ")[:60]
            print(f"{mark} {q:<48} → {a}")
    print(f"accuracy {report.accuracy:.3f} ({report.correct}/{report.n}) on {args.data}")
    if args.out:
        report.write(args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="selfdistill",
        description="On-policy self-distillation: turn feedback into durable adapters.")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("generate", help="chat completion from the model")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--user", default=None, help="resolve the adapter from the registry for this "
                   "user (user → workspace → global → base)")
    p.add_argument("--workspace", default=None, help="the workspace for registry resolution")
    p.add_argument("--registry", default=None, help="resolve the adapter from this registry (path "
                   "or URL; with only --user/--workspace: $SELFDISTILL_HOME/registry.db, else "
                   "./.selfdistill/registry.db); without --user/--workspace: the global adapter")
    p.add_argument("--json", action="store_true", help="print text and adapter metadata as JSON")
    _add_model_args(p)
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("eval", help="strict accuracy of greedy answers on a JSONL file")
    p.add_argument("--data", required=True, help='JSONL of {"prompt": ..., "answer": ...} rows')
    p.add_argument("--out", default=None, help="write the JSON report here")
    p.add_argument("--batch-size", type=int, default=16)
    _add_model_args(p)
    p.set_defaults(func=_cmd_eval)

    for mod in _PLUGINS:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name and mod.startswith(exc.name):  # feature not present in this build
                continue
            raise
        module.add_subcommand(sub)
    # `--quiet` is accepted after the sub-command too; SUPPRESS keeps the top-level value.
    for p in sub.choices.values():
        if "--quiet" not in p._option_string_actions:
            p.add_argument("--quiet", action="store_true", default=argparse.SUPPRESS,
                           help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    keep_freed_memory()  # large tensors reuse heap pages instead of fresh mmaps (allocator.py)
    bound_kernel_caches()  # oneDNN's per-shape kernels: a bounded cache, not one per shape seen
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "quiet", False):
        os.environ["TQDM_DISABLE"] = "1"
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"selfdistill: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("selfdistill: interrupted", file=sys.stderr)
        return 130


def print_json(obj: Any) -> None:
    """Machine-readable output for `--json` flags."""
    print(json.dumps(obj, indent=2, ensure_ascii=False, default=str))
