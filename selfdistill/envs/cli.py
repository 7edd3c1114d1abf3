"""`selfdistill sandbox ...`: judge one solution, or say which isolation this machine has.

selfdistill sandbox check --problem P.json --solution S.py
    prints {"passed", "reward", "status", "feedback"} and exits 0 whatever the program did;
    P.json is one code problem (format: selfdistill.envs.code); S.py is Python source or a
    model answer (its ```python block is used). A malformed problem file exits 2.
selfdistill sandbox info
    prints {"isolation", "problem"}: what `auto` resolves to here, and why not bwrap.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from selfdistill.envs import sandbox as sb
from selfdistill.envs.code import CodeEnv, CodeProblem, extract_code
from selfdistill.errors import UserError


def add_subcommand(subparsers: Any) -> None:
    """Register `sandbox check` and `sandbox info` on the main CLI's subparsers."""
    parser = subparsers.add_parser("sandbox", help="run model-written code in the sandbox")
    sub = parser.add_subparsers(dest="sandbox_command", required=True)
    check = sub.add_parser("check", help="judge one solution against one problem's tests")
    check.add_argument(
        "--problem", required=True, type=Path, help="JSON file: one code problem (prompt optional)"
    )
    check.add_argument(
        "--solution",
        required=True,
        type=Path,
        help="Python file, or a model answer containing a ```python block",
    )
    check.add_argument("--timeout", type=float, help="seconds per test (wall clock)")
    check.add_argument("--memory-mb", type=int, help="address-space limit per process, MiB")
    check.add_argument(
        "--allow-unisolated",
        action="store_true",
        help="run without isolation when bubblewrap is unavailable (unsafe)",
    )
    check.set_defaults(func=_check)
    info = sub.add_parser("info", help="which isolation this machine provides")
    info.set_defaults(func=_info)


def _check(args: argparse.Namespace) -> int:
    problem = _load_problem(args.problem)
    try:
        code = args.solution.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"{args.solution}: cannot read the solution ({exc.strerror})") from None
    overrides = {"timeout_s": args.timeout, "memory_mb": args.memory_mb}
    limits = dataclasses.replace(sb.Limits(), **{k: v for k, v in overrides.items() if v})
    sandbox = sb.Sandbox(limits, allow_unisolated=True if args.allow_unisolated else None)
    env = CodeEnv(problem, sandbox=sandbox)
    feedback = env.check(extract_code(code, problem.entry_point) if "```" in code else code)
    print(
        json.dumps(
            {
                "passed": feedback.passed,
                "reward": feedback.reward,
                "status": feedback.evidence["status"],
                "feedback": feedback.text,
            }
        )
    )
    return 0


def _load_problem(path: Path) -> CodeProblem:
    try:
        obj = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise UserError(f"{path}: cannot read the problem file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: malformed JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: expected one JSON object (a code problem)")
    try:
        return CodeProblem.from_dict(obj, str(path), require_prompt=False)
    except ValueError as exc:
        raise UserError(f"{path}: {exc}") from None


def _info(args: argparse.Namespace) -> int:
    problem = sb.bwrap_problem()
    print(json.dumps({"isolation": "bwrap" if problem is None else "none", "problem": problem}))
    return 0
