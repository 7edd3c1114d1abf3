"""The CLI contract: sub-commands, exit codes, one-line errors without tracebacks."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch

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


# 300 input shapes through one oneDNN-packed linear layer (the kernel a CPU decode runs); prints
# the growth of the resident set in bytes. argv[1] = "bounded": bound_kernel_caches(8) first.
_KERNEL_SHAPES = """
import os, sys, torch
from selfdistill.allocator import bound_kernel_caches
if sys.argv[1] == "bounded":
    bound_kernel_caches(8)  # after importing torch, before any kernel ran: as the CLI does
torch.set_num_threads(1)
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(256, 128), 8)
run = lambda m: torch.ops.mkldnn._linear_pointwise(torch.randn(m, 128), packed, None, "none",
                                                   [], "")
run(1)
before = rss()
for m in range(2, 302):
    run(m)
print(rss() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux")
                    or not torch.backends.mkldnn.is_available(),
                    reason="reads /proc; needs a PyTorch with oneDNN")
def test_bounded_kernel_caches_keep_memory_flat_over_new_shapes():
    """oneDNN keeps a compiled kernel per input shape; with `bound_kernel_caches` (called by the
    CLI) 300 new shapes leave the resident set nearly where it was, without it they grow it."""
    env = {k: v for k, v in os.environ.items() if not k.endswith("CACHE_CAPACITY")}

    def growth(mode: str) -> int:
        res = subprocess.run([sys.executable, "-c", _KERNEL_SHAPES, mode], env=env,
                             capture_output=True, text=True)
        assert res.returncode == 0, res.stderr
        return int(res.stdout.split()[-1])

    bounded, default = growth("bounded"), growth("default")
    assert bounded < 24 * 2**20, bounded
    assert default > 4 * max(bounded, 2**20), (bounded, default)  # the control: it does grow


def test_kernel_cache_bound_keeps_a_capacity_the_environment_sets(monkeypatch):
    """`bound_kernel_caches` fills in only the capacities the environment leaves unset (oneDNN's
    older DNNL_ name counts), and `selfdistill` calls it before anything else runs."""
    from selfdistill import allocator, cli

    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "DNNL_PRIMITIVE_CACHE_CAPACITY",
                 "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DNNL_PRIMITIVE_CACHE_CAPACITY", "300")
    assert allocator.bound_kernel_caches(16) == {"DNNL_PRIMITIVE_CACHE_CAPACITY": "300",
                                                 "LRU_CACHE_CAPACITY": "16"}
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ
    calls = []
    monkeypatch.setattr(cli, "bound_kernel_caches", lambda: calls.append(1))
    with pytest.raises(SystemExit):
        main(["--help"])
    assert calls == [1]


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
