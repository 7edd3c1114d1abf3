"""One checkpoint mechanism that is also the resume mechanism.

Layout: `RUN/checkpoints/step_000010/` holds `adapter/` (PEFT safetensors, or `model/` for full
fine-tuning) and `state.pt` (optimizer, scheduler, RNG states, teacher state, data position,
step). `RUN/checkpoints/index.jsonl` is append-only, one line per completed checkpoint.
A checkpoint directory is written under a temporary name and renamed into place before its
index line is appended, so a crash never leaves a corrupt latest checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from selfdistill.errors import UserError


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # sampling on the GPU
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_weights(model: Any, out: Path, state_dict: dict[str, Any] | None = None) -> None:
    """PEFT models save only the adapter; plain models save full weights (safetensors).
    `state_dict`: the model's full state gathered from a sharded engine (FSDP / DeepSpeed)."""
    if state_dict is None:
        model.save_pretrained(out, safe_serialization=True)
    else:
        model.save_pretrained(out, safe_serialization=True, state_dict=state_dict)


def save_checkpoint(run_dir: Path, step: int, model: Any, state: dict[str, Any],
                    weights: dict[str, Any] | None = None) -> Path:
    """Atomically write checkpoint `step` and append it to the index; returns its directory.
    Under data parallelism rank 0 alone calls it (`weights`: the state a sharded engine
    gathered); the checkpoint does not depend on the number of processes, so a run resumes on
    any number of them (docs/distributed.md)."""
    root = run_dir / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:06d}"
    tmp = root / f".tmp_step_{step:06d}_{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_weights(model, tmp / "weights", weights)
    torch.save({**state, "step": step}, tmp / "state.pt")
    _fsync_dir(tmp)
    if final.exists():  # re-running a step after a resume: the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    with open(root / "index.jsonl", "a") as fh:
        fh.write(json.dumps({"step": step, "path": final.name, "time": time.time()}) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint listed in the index whose directory is complete."""
    index = run_dir / "checkpoints" / "index.jsonl"
    if not index.is_file():
        return None
    entries = []
    for line in index.read_text().splitlines():
        try:
            entries.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a torn last line from a crash mid-append
    for entry in reversed(entries):
        path = run_dir / "checkpoints" / entry["path"]
        if (path / "state.pt").is_file():
            return path
    return None


def load_state(ckpt: Path) -> dict[str, Any]:
    if not (ckpt / "state.pt").is_file():
        raise UserError(f"{ckpt}: not a complete checkpoint (state.pt missing)")
    return torch.load(ckpt / "state.pt", weights_only=False)


def load_weights_into(model: Any, weights_dir: Path) -> None:
    """Copy saved adapter (or full) weights into an already-built model of the same shape."""
    from safetensors.torch import load_file

    files = sorted(weights_dir.glob("*.safetensors"))
    if not files:
        raise UserError(f"{weights_dir}: no safetensors weights")
    saved: dict[str, torch.Tensor] = {}
    for f in files:
        saved.update(load_file(f))
    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        res = set_peft_model_state_dict(model, saved)
        if getattr(res, "unexpected_keys", None):
            raise UserError(f"{weights_dir}: adapter does not fit this model")
    else:
        model.load_state_dict(saved, strict=False)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
