"""The CLI contract: sub-commands, exit codes, one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from selfdistill.cli import main


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "selfdistill", *args], capture_output=True,
                          text=True, timeout=kw.get("timeout", 300))


def test_help_lists_subcommands():
    res = run_cli("--help")
    assert res.returncode == 0
    for cmd in ("generate", "eval", "train"):
        assert cmd in res.stdout


@pytest.mark.parametrize("args, needle", [
    (["eval", "--data", "/nonexistent/x.jsonl"], "no such file"),
    (["eval", "--data", "{tmp}/bad.jsonl"], "bad.jsonl:2: malformed JSON"),
    (["eval", "--data", "{tmp}/ok.jsonl", "--model", "/nonexistent/model"], "no such directory"),
    (["eval", "--data", "{tmp}/ok.jsonl", "--model", "{tmp}"], "has no config.json"),
    (["train", "{tmp}/cfg.yaml"], "unknown key"),
    (["train", "{tmp}/missing.yaml"], "no such config file"),
])
def test_bad_input_exit_2_one_line(tmp_path, capsys, args, needle):
    (tmp_path / "ok.jsonl").write_text(json.dumps({"prompt": "q", "answer": "a"}) + "\n")
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "q", "answer": "a"}) + "\n{oops\n")
    (tmp_path / "cfg.yaml").write_text("train_data: x.jsonl\nlearning_rat: 0.1\n")
    code = main([a.replace("{tmp}", str(tmp_path)) for a in args])
    err = capsys.readouterr().err
    assert code == 2
    assert needle in err
    assert "Traceback" not in err
    assert err.startswith("selfdistill: error: ")


def test_argparse_errors_exit_2():
    res = run_cli("eval")  # --data missing
    assert res.returncode == 2
    assert "--data" in res.stderr


def test_eval_on_default_model(tmp_path, default_dir):
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [
        {"prompt": "What is the capital of France?", "answer": "Paris"},
        {"prompt": "What is the capital of Germany?", "answer": ["Berlin"]},
        {"prompt": "What is the capital of Veloria?", "answer": "Marquenta"},
    ]))
    out = tmp_path / "report.json"
    res = run_cli("eval", "--data", str(data), "--model", default_dir, "--out", str(out),
                  "--quiet")
    assert res.returncode == 0, res.stderr
    report = json.loads(out.read_text())
    assert report["n"] == 3
    assert set(report["items"][0]) >= {"prompt", "completion", "answer", "correct"}
    # The base model knows the two real capitals and cannot know the invented one.
    assert [i["correct"] for i in report["items"]] == [True, True, False]
    assert report["accuracy"] == pytest.approx(2 / 3)
    assert "accuracy 0.667 (2/3)" in res.stdout


def test_generate_with_default_model(default_dir):
    res = run_cli("generate", "--prompt", "What is the capital of France? Answer in one word.",
                  "--model", default_dir, "--max-new-tokens", "8", "--quiet")
    assert res.returncode == 0, res.stderr
    assert "paris" in res.stdout.lower()


def test_allocator_setting_applies_in_a_fresh_process_and_can_be_turned_off():
    """`keep_freed_memory` (called by the CLI) sets glibc's mallopt; `SELFDISTILL_MALLOC=system`
    opts out. Run in subprocesses: the setting is process-wide."""
    code = "from selfdistill.allocator import keep_freed_memory as k; print(k())"
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "SELFDISTILL_MALLOC": "system"})
    glibc = platform.libc_ver()[0] == "glibc"
    assert on.stdout.strip() == str(glibc)
    assert off.stdout.strip() == "False"
