"""Teacher regimes: which weights the teacher runs with while it scores the student's tokens.

- `live`: the current student weights.
- `base`: the initial weights. With a PEFT model the adapter is disabled for the forward (no
  second copy); with full fine-tuning a copy of the initial trainable parameters is kept.
- `ema`: θ_T ← (1−r)·θ_T + r·θ_S after every optimizer step, θ_T starting at the student's
  weights at `setup`, so after k steps θ_T = (1−r)^k·θ_0 + Σ_{j=1..k} r·(1−r)^(k−j)·θ_j.
- `trust_region`: logits = (1−r)·base + r·live (both under the teacher context).
- `model`: a different model's weights (on-policy distillation); see `teacher/model_teacher.py`,
  whose `load_teacher` builds it (it needs the other model and checks its tokenizer).

Departure from a second PEFT adapter for `ema`: the EMA copy is a plain dict of detached tensors,
one per trainable parameter (with LoRA: the "default" adapter's A/B matrices), substituted for the
forward with `torch.func.functional_call`. Nothing is copied into the model in place, so the
student's autograd graph stays valid whichever forward runs first; no `set_adapter` call flips
`requires_grad`; the EMA tensors are not module parameters, so no optimizer or `save_pretrained`
can pick them up; and LoRA and full fine-tuning share one code path. EMA is taken over each
parameter (A and B separately, as any EMA of adapter weights is), not over the product B·A.

Seed 003 (article "What exactly is On-Policy Distillation"): a frozen teacher works early and
collapses later; live works; EMA and trust region are best.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch import Tensor

from selfdistill.models import cache_arg, output_cache

REGIMES = ("base", "live", "ema", "trust_region", "model")


def is_peft(model: Any) -> bool:
    """Whether `model` is a PEFT model (has `disable_adapter()`)."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but a bare torch model needs no adapter support
        return False
    return isinstance(model, PeftModel)


def model_logits(
    forward: Callable[..., Any],
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    completion_width: int,
    prefix_width: int = 0,
    cache: Any = None,
) -> Tensor:
    """Logits predicting the last T = `completion_width` columns, (B, T, V): one causal-LM
    forward, the output head run at columns W−T−1 … W−2 only (W = the batch's width).

    `forward` is the model or a callable with its signature. The positions go to HF's
    `logits_to_keep` as an index tensor: HF then gathers them into a contiguous (B, T, H) block
    and the head is one matmul, where an int's strided slice made it a batched matmul over a
    broadcast (V, H) weight at a third of the speed (2-core AVX2 CPU, (32, 25) positions,
    profiled: 1.75 s → 0.81 s forward+backward). Asking for exactly the T positions, rather than
    the last T+1 and slicing off the final one, keeps the result contiguous and spares the
    slice's backward a zero-filled (B, T+1, V) gradient and a copy (measured: 0.28 s of a 4.4 s
    student forward+backward, 8 × 112 tokens, default model). Models that ignore
    `logits_to_keep` and return every position are indexed here.

    `prefix_width` S > 0 (the first S columns are the same real tokens in every row, see
    `scoring.build_batch(share_prefix=True)`): the prefix runs once, batch 1, and its keys and
    values are repeated to the B rows as the cache the remaining columns attend to — with
    gradient, so the result and its gradient equal the plain forward's (the repeat's backward
    sums the B rows' contributions), for ~S·(B−1) fewer token-forwards. T+1 must not reach into
    the prefix. `cache` (an HF cache holding B rows' keys and values of the first S columns,
    e.g. `PromptCache.assemble`): used as it is instead of running the prefix.
    """
    width, t = input_ids.shape[1], completion_width
    s = max(prefix_width, 0)
    if t + 1 > width - s:
        raise ValueError(f"completion_width={t} needs {t + 1} columns after the shared prefix "
                         f"({s} of {width} columns)")
    keep = torch.arange(width - s - t - 1, width - s - 1, device=input_ids.device)
    if s == 0:
        out = forward(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, logits_to_keep=keep, use_cache=False)
    else:
        if cache is None:
            cache = prefill(forward, input_ids[:1, :s], attention_mask[:1, :s],
                            position_ids[:1, :s])
            cache.batch_repeat_interleave(input_ids.shape[0])
        out = forward(input_ids=input_ids[:, s:], attention_mask=attention_mask,
                      position_ids=position_ids[:, s:], logits_to_keep=keep, **cache_arg(cache),
                      use_cache=True)
    logits = out.logits
    return logits if logits.shape[1] == t else logits[:, keep]


def prefill(forward: Callable[..., Any], input_ids: Tensor, attention_mask: Tensor,
            position_ids: Tensor) -> Any:
    """The HF cache (keys and values of every layer) of one forward over `input_ids`; the
    output head runs on the last position only."""
    last = torch.tensor([input_ids.shape[1] - 1], device=input_ids.device)
    return output_cache(forward(input_ids=input_ids, attention_mask=attention_mask,
                                position_ids=position_ids, logits_to_keep=last, use_cache=True))


@contextlib.contextmanager
def teacher_mode(model: torch.nn.Module) -> Iterator[None]:
    """`no_grad` and eval mode (no dropout); restores every module's mode, every parameter's
    `requires_grad` (PEFT's `disable_adapter` rewrites them) and the active adapter on exit."""
    modes = [(m, m.training) for m in model.modules()]
    grads = [(p, p.requires_grad) for p in model.parameters()]
    adapter = getattr(model, "active_adapter", None) if is_peft(model) else None
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if adapter is not None and model.active_adapter != adapter:
            model.set_adapter(adapter)
        for p, requires_grad in grads:
            p.requires_grad_(requires_grad)
        for m, training in modes:
            m.training = training


class _Snapshot:
    """Detached copies of a model's trainable parameters, by name, run in place of the live ones."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] | None = None

    def capture(self, model: torch.nn.Module, what: str) -> None:
        """Copy the trainable parameters now, or adopt tensors loaded by `load` (checked)."""
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not params:
            raise ValueError(f"the {what} teacher needs trainable parameters; the model has none")
        if self.tensors is None:
            self.tensors = {n: p.detach().clone() for n, p in params.items()}
            return
        if set(self.tensors) != set(params):
            missing, extra = set(params) - set(self.tensors), set(self.tensors) - set(params)
            raise ValueError(
                f"{what} teacher state does not match the model's trainable parameters: "
                f"missing {sorted(missing)[:3]}, extra {sorted(extra)[:3]}"
            )
        for n, p in params.items():
            if self.tensors[n].shape != p.shape:
                raise ValueError(
                    f"{what} teacher state: {n} has shape "
                    f"{tuple(self.tensors[n].shape)}, model has {tuple(p.shape)}"
                )
            self.tensors[n] = self.tensors[n].to(device=p.device, dtype=p.dtype)

    def load(self, tensors: dict[str, Tensor] | None) -> None:
        """Adopt copies of saved tensors; `capture` checks them against the model."""
        if tensors is not None:
            tensors = {n: t.detach().clone() for n, t in tensors.items()}
        self.tensors = tensors

    def forward(self, model: torch.nn.Module) -> Callable[..., Any]:
        """A callable running `model` with the snapshot in place of its trainable parameters."""
        tensors = self.tensors
        assert tensors is not None, "capture() first"
        return lambda **kwargs: torch.func.functional_call(model, tensors, (), kwargs)


class TeacherRegime(ABC):
    """Which weights the teacher uses. One instance per training run.

    `setup(model)` must see the initial weights (it is called by the first `teacher_logits`,
    which in a training loop comes before the first optimizer step); resume restores the same
    state with `load_state_dict` before the first call.
    """

    name: ClassVar[str]
    frozen: ClassVar[bool] = False
    """The teacher's weights never change during training (base, model): a prompt's keys and
    values computed once stay valid for the whole run (`PromptCache`)."""

    def __init__(self, rate: float = 0.05) -> None:
        self.rate = rate
        self._ready = False

    def setup(self, model: torch.nn.Module) -> None:
        """Capture what the regime needs from the model's initial weights; idempotent."""
        self._ready = True

    def teacher_logits(
        self,
        model: torch.nn.Module,
        input_ids: Tensor,
        attention_mask: Tensor,
        position_ids: Tensor,
        completion_width: int,
        prefix_width: int = 0,
        cache: Any = None,
    ) -> Tensor:
        """Teacher logits predicting the last `completion_width` columns, (B, T, V), without
        gradient (see `model_logits`).

        Runs in eval mode; the model's modes, `requires_grad` flags and active adapter are
        restored afterwards. `prefix_width`, `cache`: see `model_logits`.
        """
        if not self._ready:
            self.setup(model)
        inputs = (input_ids, attention_mask, position_ids, completion_width, prefix_width,
                  cache)
        with teacher_mode(model):
            return self._logits(model, *inputs)

    def prompt_kv(self, model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor,
                  position_ids: Tensor) -> Any:
        """The HF cache of one forward over a prompt batch under the teacher's weights."""
        if not self._ready:
            self.setup(model)
        with teacher_mode(model), self._weights(model) as forward:
            return prefill(forward, input_ids, attention_mask, position_ids)

    def _logits(self, model: torch.nn.Module, *inputs: Any) -> Tensor:
        with self._weights(model) as forward:
            return model_logits(forward, *inputs)

    @abstractmethod
    def _weights(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[Any]:
        """A context yielding a callable that runs `model`'s forward with the teacher's weights."""

    def after_step(self, model: torch.nn.Module) -> None:
        """Called after every optimizer step; only `ema` does anything."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must save to resume this regime (tensors are not copied)."""
        return {"name": self.name}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()` output (copied); checked against the model at the next call.

        `rate` is configuration, not state: a resumed run uses the rate it was built with.
        """
        if state.get("name") != self.name:
            raise ValueError(
                f"teacher state is for regime {state.get('name')!r}, not {self.name!r}"
            )
        self._ready = False


class LiveRegime(TeacherRegime):
    """The teacher is the current student."""

    name = "live"

    @contextlib.contextmanager
    def _weights(self, model: torch.nn.Module) -> Iterator[Any]:
        yield model


class BaseRegime(TeacherRegime):
    """The teacher is the initial model: PEFT adapter disabled, or a copy of the initial weights."""

    name = "base"
    frozen = True

    def __init__(self, rate: float = 0.05) -> None:
        super().__init__(rate)
        self._initial = _Snapshot()  # full fine-tuning only

    def setup(self, model: torch.nn.Module) -> None:
        if self._ready:
            return
        if not is_peft(model):
            self._initial.capture(model, self.name)
        super().setup(model)

    @contextlib.contextmanager
    def _weights(self, model: torch.nn.Module) -> Iterator[Any]:
        if is_peft(model):
            with model.disable_adapter():
                yield model
        else:
            yield self._initial.forward(model)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "initial": self._initial.tensors}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._initial.load(state["initial"])


class EmaRegime(TeacherRegime):
    """The teacher runs with an exponential moving average (rate r) of the trainable weights."""

    name = "ema"

    def __init__(self, rate: float = 0.05) -> None:
        super().__init__(rate)
        self.ema = _Snapshot()
        self.steps = 0  # optimizer steps averaged in

    def setup(self, model: torch.nn.Module) -> None:
        if not self._ready:
            self.ema.capture(model, self.name)
            super().setup(model)

    @contextlib.contextmanager
    def _weights(self, model: torch.nn.Module) -> Iterator[Any]:
        yield self.ema.forward(model)

    @torch.no_grad()
    def after_step(self, model: torch.nn.Module) -> None:
        """θ_T ← (1−r)·θ_T + r·θ_S, i.e. `lerp(θ_T, θ_S, r)`, for every trainable parameter."""
        if not self._ready:
            raise RuntimeError(
                "ema teacher: call setup(model) (or teacher_logits) before the "
                "first optimizer step, so the average starts at the initial weights"
            )
        params = dict(model.named_parameters())
        ema = self.ema.tensors
        assert ema is not None
        names = list(ema)
        torch._foreach_lerp_(
            [ema[n] for n in names], [params[n].detach() for n in names], self.rate
        )
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "ema": self.ema.tensors, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.ema.load(state["ema"])
        self.steps = state["steps"]


class TrustRegionRegime(TeacherRegime):
    """Teacher logits = lerp(base, live, r) = (1−r)·base + r·live: two forwards per call."""

    name = "trust_region"

    def __init__(self, rate: float = 0.05) -> None:
        super().__init__(rate)
        self._base = BaseRegime(rate)

    def setup(self, model: torch.nn.Module) -> None:
        self._base.setup(model)
        super().setup(model)

    def _logits(self, model: torch.nn.Module, *inputs: Any) -> Tensor:
        base = self._base._logits(model, *inputs)
        return base.lerp_(model_logits(model, *inputs), self.rate)

    @contextlib.contextmanager
    def _weights(self, model: torch.nn.Module) -> Iterator[Any]:
        raise NotImplementedError("trust_region mixes two forwards' logits: it has no single "
                                  "set of weights (and no prompt cache)")
        yield  # pragma: no cover (makes this a generator)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "base": self._base.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._base.load_state_dict(state["base"])


_CLASSES: dict[str, type[TeacherRegime]] = {
    cls.name: cls for cls in (BaseRegime, LiveRegime, EmaRegime, TrustRegionRegime)
}


def make_regime(name: str, *, rate: float = 0.05) -> TeacherRegime:
    """The teacher regime called `name` (one of `REGIMES`).

    `rate` r in (0, 1] is the EMA step for `ema` and the weight of the live logits for
    `trust_region`; the other regimes ignore it.
    """
    if name == "model":
        raise ValueError("teacher regime 'model' needs the other model: build it with "
                         "selfdistill.teacher.load_teacher(path, student_tokenizer)")
    if name not in _CLASSES:
        raise ValueError(f"unknown teacher regime {name!r}: choose one of {', '.join(REGIMES)}")
    if name in ("ema", "trust_region") and not 0.0 < rate <= 1.0:
        raise ValueError(f"teacher regime {name!r} needs 0 < rate <= 1, got {rate}")
    return _CLASSES[name](rate)
