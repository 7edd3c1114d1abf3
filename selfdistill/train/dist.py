"""Data-parallel training on the engine users already run: a thin wrapper over `accelerate`.

    accelerate launch --multi_gpu --num_processes N -m selfdistill train CONFIG.yaml   # N ranks
    selfdistill train CONFIG.yaml                                                        # 1 process

(On a machine without CUDA, `--multi_gpu` still starts N processes and `Dist.from_env` asks
accelerate for CPU ranks, which then talk over gloo; `--cpu --num_processes N` starts only one.)

What each rank does (docs/distributed.md):
- takes its contiguous shard of the step's global batch (`Dist.shard`), samples it with seeded
  per-sample streams (`rollout.seeding`), scores it with the teacher and computes the loss locally;
- normalizes each loss term by the *global* token count divided by the world size W, so that the
  engine's gradient average equals the one-process gradient:

      mean_r ∇(Σ_{tokens of r} ℓ / (N / W)) = ∇(Σ_{all tokens} ℓ / N);

- lets the engine (DDP, FSDP, DeepSpeed: whatever `accelerate launch` was told) reduce gradients.
Rank 0 alone writes checkpoints, metrics, traces, evaluations and the progress bar.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch

from selfdistill.errors import UserError

COLLECTIVE_TIMEOUT_S = 4 * 3600
"""How long a rank waits in a collective for the others (rank 0's evaluations included)."""

SUM_METRICS = frozenset({"samples", "no_context", "anchor_samples", "truncated_tokens", "tokens",
                         "tokens_per_s"})
"""Metrics that add up over ranks; every other metric is averaged over the ranks reporting it."""


def launched_distributed() -> bool:
    """Whether this process was started by a multi-process launcher (`accelerate launch`,
    `torchrun`) or asked for a sharding engine (FSDP / DeepSpeed) even on one process."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    engine = any(os.environ.get(k, "").lower() in ("1", "true")
                 for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED"))
    return world > 1 or engine


class Dist:
    """Rank, world size and the few collectives the trainer needs. Without an `Accelerator`
    (one plain process) every collective is the identity."""

    def __init__(self, accelerator: Any = None) -> None:
        self.accelerator = accelerator
        self.rank = accelerator.process_index if accelerator is not None else 0
        self.world = accelerator.num_processes if accelerator is not None else 1

    @classmethod
    def from_env(cls) -> Dist:
        """One process unless launched by `accelerate launch` / `torchrun` (see module doc)."""
        if not launched_distributed():
            return cls()
        from accelerate import Accelerator
        from accelerate.utils import InitProcessGroupKwargs

        # rank 0 evaluates alone (before / after training) while the others wait in a
        # collective: allow that to take longer than the 30-minute default
        wait = InitProcessGroupKwargs(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            return cls(Accelerator(cpu=not torch.cuda.is_available(), kwargs_handlers=[wait]))
        except (RuntimeError, ImportError, ValueError) as exc:
            engine = ("FSDP" if os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")
                      else "DeepSpeed" if os.environ.get("ACCELERATE_USE_DEEPSPEED") else "")
            hint = (f" {engine} shards over GPUs; on CPU launch plain data parallelism: "
                    "`accelerate launch --multi_gpu --num_processes N -m selfdistill train ...`"
                    if engine else "")
            why = str(exc).rstrip(".")
            raise UserError(f"accelerate could not start this process: {why}.{hint} "
                            "(docs/distributed.md)") from None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device | None:
        """The device accelerate assigned to this rank; None = one process (config decides)."""
        return self.accelerator.device if self.accelerator is not None else None

    @property
    def engine(self) -> str:
        """'none' (one process), or accelerate's distributed type: 'MULTI_CPU', 'MULTI_GPU',
        'FSDP', 'DEEPSPEED', ..."""
        if self.accelerator is None:
            return "none"
        return str(self.accelerator.distributed_type).rsplit(".", 1)[-1]

    def shard(self, n: int, what: str) -> slice:
        """This rank's contiguous part of `n` items; `n` must divide evenly over the ranks, so
        every rank holds whole prompts (and whole GRPO groups)."""
        if n % self.world:
            raise UserError(f"{what}={n} does not split over {self.world} processes: use a "
                            f"multiple of {self.world} (or launch a number of processes that "
                            f"divides {n})")
        size = n // self.world
        return slice(self.rank * size, (self.rank + 1) * size)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """The engine's wrapper of `model` (DDP / FSDP / DeepSpeed), used for the student's
        training forward; `model` itself stays the module that generates and is saved.
        The optimizer must be built over the returned module's parameters (FSDP flattens)."""
        if self.accelerator is None:
            return model
        return self.accelerator.prepare_model(model)

    def backward(self, loss: torch.Tensor) -> None:
        if self.accelerator is None:
            loss.backward()
        else:
            self.accelerator.backward(loss)

    def clip_grad_norm_(self, train_model: torch.nn.Module, max_norm: float | None) -> float:
        """Clip the (already reduced) gradients to `max_norm`; returns the global norm before
        clipping (0.0 when clipping is off)."""
        if not max_norm:
            return 0.0
        if self.accelerator is None:
            params = [p for p in train_model.parameters() if p.requires_grad]
            return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        # accelerate matches the list against the prepared models (FSDP clips its own shards)
        return float(self.accelerator.clip_grad_norm_(list(train_model.parameters()), max_norm))

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (one all-reduce)."""
        if self.accelerator is None:
            return list(values)
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return t.tolist()

    def global_counts(self, counts: dict[str, float]) -> dict[str, float]:
        """Per-rank loss denominators: the token counts summed over ranks, divided by W (see
        the module docstring). The identity on one process."""
        keys = sorted(counts)
        total = self.sum([counts[k] for k in keys])
        return {k: v / self.world for k, v in zip(keys, total, strict=True)}

    def any(self, flag: bool) -> bool:
        """True on every rank when it is true on some rank."""
        return self.sum([float(flag)])[0] > 0

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""
        if self.accelerator is None:
            return [obj]
        out: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def reduce_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """One step's metrics over all ranks: `SUM_METRICS` add up, the rest are averaged over
        the ranks that report them. With the normalization above, the mean `loss` is the
        one-process loss."""
        if self.accelerator is None:
            return metrics
        per_rank = self.gather(metrics)
        out: dict[str, float] = {}
        for key in dict.fromkeys(k for m in per_rank for k in m):
            vals = [float(m[key]) for m in per_rank if key in m]
            out[key] = sum(vals) if key in SUM_METRICS else sum(vals) / len(vals)
        return out

    @property
    def sharded(self) -> bool:
        """Whether the engine shards weights / optimizer states over ranks (FSDP, DeepSpeed)."""
        return self.engine in ("FSDP", "DEEPSPEED")

    def full_state_dict(self, train_model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """Sharded engines: the full (unwrapped) state dict, gathered from every rank — call it
        on every rank; rank 0 writes it. None otherwise: each rank holds the whole model.
        (Not run here: accelerate refuses FSDP without a GPU, docs/distributed.md.)"""
        if not self.sharded:
            return None
        return self.accelerator.get_state_dict(train_model)

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """What a checkpoint keeps of the optimizer: its state dict (identical on every rank
        under DDP); None under sharded engines, whose per-rank shards are not written (a resume
        then restarts the AdamW moments, docs/distributed.md)."""
        return None if self.sharded else optimizer.state_dict()

    def barrier(self) -> None:
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()

    def close(self) -> None:
        """Leave the process group (the launcher then reaps the ranks)."""
        if self.accelerator is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


SINGLE = Dist()
"""The one-process `Dist` (every collective the identity)."""
