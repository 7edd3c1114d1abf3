"""Data-parallel training on CPU: real `accelerate launch` processes talking over gloo.

Two ranks with the same global batch and seed must train the same adapter as one process; a
checkpoint written by two ranks must resume on one; rank 0 alone logs. (docs/distributed.md)
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from selfdistill.errors import UserError
from selfdistill.train import load_config, run_training
from selfdistill.train.dist import Dist
from selfdistill.train.methods import LossInputs, Sample, method_loss, token_counts
from tests.serve_world import free_port

ROOT = Path(__file__).resolve().parent.parent
KNOWLEDGE = ROOT / "examples" / "knowledge.yaml"
TOL = 2e-5  # float32 sums in a different order (per-rank batches are padded differently)


def _overrides(tiny_dir: str, out: Path) -> list[str]:
    # anchors (a second sampling stream and loss term) and two updates per batch (importance
    # correction) exercise every piece that is sharded or normalized across ranks
    return [f"model={tiny_dir}", f"output_dir={out}", "steps=4", "batch_size=4",
            "max_new_tokens=6", "eval.max_new_tokens=2", "eval.every_steps=0",
            "eval.oracle=false", "probe_data=null", "checkpoint_every=2", "threads=1",
            "anchor_data=builtin", "anchor_batch_size=2", "updates_per_batch=2",
            "precision=float32"]  # bf16 autocast rounds differently shaped rank batches apart


def launch(nproc: int, *args: str, fsdp: bool = False, quiet: bool = True,
           timeout: float = 300) -> subprocess.CompletedProcess:
    """`accelerate launch [--use_fsdp | --multi_gpu] --num_processes N -m selfdistill ...`."""
    cmd = [sys.executable, "-m", "accelerate.commands.launch",
           "--use_fsdp" if fsdp else "--multi_gpu", "--num_processes", str(nproc),
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--num_cpu_threads_per_process", "1", "--main_process_port", str(free_port()),
           "-m", "selfdistill", *(["--quiet"] if quiet else []), *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def adapter(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def runs(tiny_dir, tmp_path_factory):
    """The same job on one process (in-process) and on two ranks (with its progress bar on)."""
    root = tmp_path_factory.mktemp("dist")
    one, two = root / "one", root / "two"
    run_training(load_config(KNOWLEDGE, _overrides(tiny_dir, one)), progress=False)
    res = launch(2, "train", str(KNOWLEDGE), *_overrides(tiny_dir, two), quiet=False)
    (root / "two.stderr").write_text(res.stderr)  # kept for debugging a failure
    assert res.returncode == 0, res.stderr[-3000:]
    return SimpleNamespace(one=one, two=two, tiny_dir=tiny_dir, stderr=res.stderr,
                           stdout=res.stdout)


def test_two_ranks_train_the_same_adapter_as_one_process(runs):
    a, b = adapter(runs.one), adapter(runs.two)
    assert max(float(v.abs().max()) for v in a.values()) > 1e-3  # it did train
    assert max_diff(a, b) < TOL
    m1, m2 = metrics(runs.one), metrics(runs.two)
    assert [m["step"] for m in m2] == [1, 2, 3, 4]  # logged once per step: rank 0 only
    for x, y in zip(m1, m2, strict=True):
        assert y["samples"] == x["samples"] == 6  # 4 task prompts + 2 anchors, summed over ranks
        assert y["tokens"] == x["tokens"]  # the same tokens were sampled
        # float32 noise of a KL near 0 (~1e-4 here) is ~1e-7 absolute
        assert y["loss"] == pytest.approx(x["loss"], rel=1e-4, abs=1e-6)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4)


def test_rank_zero_alone_writes_traces_output_and_progress_bar(runs):
    # the trace store holds the global batch of every step, gathered to rank 0, recorded once
    counts = []
    for run in (runs.one, runs.two):
        with sqlite3.connect(run / "traces.db") as db:
            counts.append([db.execute(f"select count(*) from {t}").fetchone()[0]
                           for t in ("attempts", "training_steps", "checkpoints")])
    assert counts[0] == counts[1] == [24, 4, 2]
    # one progress bar, not one per rank: its first render (no postfix yet) appears once
    assert len(re.findall(r"train sdft:   0%\|[^\r\n]*\?it/s\]", runs.stderr)) == 1
    assert runs.stdout.count("gate verdict:") == 1


def test_a_two_rank_checkpoint_resumes_on_one_process(runs, tmp_path):
    # simulate a crash right after the step-2 checkpoint of the two-rank run
    run = tmp_path / "resumed"
    shutil.copytree(runs.two, run)
    shutil.rmtree(run / "checkpoints" / "step_000004")
    shutil.rmtree(run / "adapter")
    index = run / "checkpoints" / "index.jsonl"
    index.write_text(index.read_text().splitlines()[0] + "\n")
    assert json.loads(index.read_text())["step"] == 2
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, "-m", "selfdistill", "--quiet", "train", "--resume",
                          str(run)], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert max_diff(adapter(run), adapter(runs.one)) < TOL
    assert [m["step"] for m in metrics(run)] == [1, 2, 3, 4]


def test_fsdp_on_cpu_stops_with_one_clear_line(tiny_dir, tmp_path):
    """accelerate's FSDP plugin refuses a machine without an accelerator device; the trainer
    turns that into its usual one-line error naming the CPU alternative (exit 2 per rank)."""
    res = launch(2, "train", str(KNOWLEDGE), *_overrides(tiny_dir, tmp_path / "r"), fsdp=True,
                 timeout=120)
    assert res.returncode != 0
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("selfdistill: error:")]
    assert len(lines) == 2, res.stderr[-2000:]  # one line per rank
    assert "no available devices found" in lines[0] and "--multi_gpu" in lines[0]
    assert str(ROOT / "selfdistill") not in res.stderr  # no traceback through our code


def test_a_batch_that_does_not_split_over_the_ranks_is_refused():
    rank1 = Dist(SimpleNamespace(process_index=1, num_processes=2))
    assert rank1.shard(6, "batch_size") == slice(3, 6)
    with pytest.raises(UserError, match="batch_size=5 does not split over 2 processes"):
        rank1.shard(5, "batch_size")


def test_globally_normalized_shard_losses_average_to_the_whole_batch_gradient():
    """mean over ranks of ∇L_r, with L_r = Σ_r ℓ / (N / W), equals ∇ of the one-process token
    mean — for distillation (task + anchor rows) and the GRPO term alike."""
    torch.manual_seed(0)
    cfg = load_config(None, ["train_data=x", "method=sdpo", "num_generations=2",
                             "loss.distillation_weight=0.5", "loss.anchor_weight=0.3"]).loss
    B, T, V = 8, 5, 11
    student = torch.randn(B, T, V, requires_grad=True)
    teacher, ids = torch.randn(B, T, V), torch.randint(0, V, (B, T))
    mask = torch.rand(B, T) > 0.3
    row = SimpleNamespace(answers=[])
    samples = [Sample(i, row, i // 2, [1], [1] * T, reward=float(i % 3 == 0)) for i in range(B)]
    samples[6].anchor = samples[7].anchor = True  # the last group on rank 1 holds anchors
    samples[6].reward = samples[7].reward = None

    def grad(rows: list[int], counts: dict | None) -> torch.Tensor:
        ctx = [i for i in range(len(rows)) if i % 4 != 1]  # some rows without teacher context
        x = LossInputs(student[rows], ids[rows], mask[rows], teacher[rows][ctx],
                       torch.tensor(ctx), counts)
        ss = [samples[r] for r in rows]
        loss, _ = method_loss("sdpo", ss, x, cfg, update=0, group_size=2)
        return torch.autograd.grad(loss, student)[0]

    halves = [list(range(4)), list(range(4, 8))]
    local = [token_counts([samples[r] for r in h], mask[h],
                          [i for i in range(4) if i % 4 != 1]) for h in halves]
    whole = token_counts(samples, mask, [i for i in range(8) if i % 4 != 1])
    assert {k: local[0][k] + local[1][k] for k in whole} == whole
    glob = {k: v / 2 for k, v in whole.items()}
    averaged = (grad(halves[0], glob) + grad(halves[1], glob)) / 2
    assert torch.allclose(averaged, grad(list(range(8)), None), atol=1e-7)


def test_bfloat16_base_and_gradient_checkpointing_train_the_same_float32_adapter(
        tiny_dir, tmp_path, monkeypatch):
    """The memory options of the GPU recipes: bfloat16 frozen weights keep a float32 adapter,
    and recomputing activations (gradient checkpointing) does not change the update."""
    import transformers.modeling_utils as mu

    calls, real = [], mu.checkpoint
    monkeypatch.setattr(mu, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for gc in (False, True):
        over = [o for o in _overrides(tiny_dir, tmp_path / f"gc{gc}") if "anchor" not in o]
        # share_prefix is off under gradient checkpointing (`loop.share_prefix`): off in both
        # runs, so the two compute the same forward and only the recomputation differs.
        cfg = load_config(KNOWLEDGE, [*over, "steps=1", "base_dtype=bfloat16",
                                      "share_prefix=false",
                                      f"gradient_checkpointing={str(gc).lower()}"])
        run_training(cfg, progress=False)
        out[gc] = adapter(tmp_path / f"gc{gc}")
        assert bool(calls) == gc  # layers were recomputed only when asked
    assert all(v.dtype == torch.float32 for v in out[True].values())
    assert max(float(v.abs().max()) for k, v in out[True].items() if "lora_B" in k) > 0
    assert max_diff(out[False], out[True]) < 1e-6


@pytest.mark.parametrize("path", sorted((ROOT / "examples" / "gpu").glob("*.yaml")))
def test_gpu_recipes_are_valid_configs(path):
    """The GPU recipes are not run here (no GPU); their keys, types and data paths are checked."""
    cfg = load_config(path)
    assert Path(cfg.train_data).is_file() and cfg.model.startswith("Qwen/Qwen3-")
    assert cfg.batch_size % 8 == 0 and cfg.base_dtype == "bfloat16"
