"""The weights a decode runs with, prepared once per `generate` call instead of at every step.

A decode step of a small model does little work per kernel (8 rows × one token), so what each
linear layer costs beyond its matmul dominates: PEFT's three matmuls and Python per LoRA layer,
autocast re-casting every float32 weight at every step, and — on a CPU — a BLAS call that is
slow for a handful of rows. `decode_weights` removes all three for the block it guards:

- **fold**: each LoRA layer's update is folded into a copy of its base weight, W' = W + s·B·A,
  and the adapter layers are switched off (one matmul per layer instead of three);
- **cast**: under autocast, each frozen weight is kept in autocast's dtype (autocast would round
  it to that dtype anyway, but without a cast cache under no_grad it does so at every step);
- **pack**: on a CPU with oneDNN, each frozen weight is reordered once into oneDNN's blocked
  layout and the layer runs `mkldnn._linear_pointwise` on it (PyTorch's own CPU-inference path
  for linear layers under `torch.compile` with frozen weights). Measured on a 2-core AVX2 EPYC,
  8 rows: 576→1536 0.29 vs 0.72 ms, the 576→49152 output head 10.7 vs 45.4 ms per call.
- **fuse** (asked for by the caller, with packing): sibling layers that read the same input
  (a decoder layer's q, k, v projections; its gate and up projections) are packed as one
  weight [W₁; W₂; …], so one call computes all their outputs. A decode step's call is mostly
  fixed cost: the default model's 30 layers' projections, bf16, 8 rows, each weight read cold
  from memory, took 15.5–17.5 ms as 7 calls per layer and 12.3–14.7 ms as 4 (2-core Xeon with
  AMX). The caller runs the fused call (`DecodeWeights.fused`); a member layer called by
  itself slices its part of the fused output (correct, not fast).

The function is the same up to float rounding (oneDNN accumulates in another order:
|Δ| ~ 1e-6 relative in float32). Parameters are never modified: the copies live only while the
block runs, and every module is restored on exit. "Frozen" = not `requires_grad` (with LoRA:
the base weights and the output head), plus the folded layers; trainable weights and the
adapter's own A and B run as they are, so full fine-tuning decodes as before.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from selfdistill.teacher.regimes import is_peft, teacher_mode


@dataclass(frozen=True)
class DecodeWeights:
    """What `decode_weights` did: LoRA folded in (adapter layers off), how many linear layers
    run through oneDNN-packed weights, and the fused groups: the ids of a group's modules (as
    given in `fuse`) → x ↦ x·[W₁; W₂; …]ᵀ (+ the biases), the members' outputs concatenated."""

    folded: bool
    packed: int
    fused: dict[tuple[int, ...], Callable[[torch.Tensor], torch.Tensor]] = field(
        default_factory=dict)


@contextlib.contextmanager
def decode_weights(model: Any, *, fold: bool = True, pack: bool = True,
                   fuse: Sequence[tuple[Any, ...]] = ()) -> Iterator[DecodeWeights]:
    """Run the block (without gradients) with `model`'s frozen linear layers folded, cast and
    packed as the module docstring describes; `fold` / `pack` switch those two off. `fuse`:
    groups of sibling projection modules (linear or LoRA layers) to pack as one weight; a group
    is fused only when each member is prepared here (frozen, or its LoRA update folded in).

    Folding is skipped (`folded=False`) for a model that is not PEFT, an adapter already merged
    or disabled, or a layer kind PEFT cannot give a plain delta for (DoRA). Packing needs a CPU
    tensor in float32, or bf16 where oneDNN runs it natively. Memory: one extra copy of every
    prepared weight while the block runs (half size when cast to bf16).
    """
    peft = is_peft(model)
    layers = _lora_layers(model) if fold and peft else []
    adapted = {id(layer.get_base_layer()): layer for layer in layers}
    own = _adapter_sublayers(model) if peft else set()  # small, and off when folded
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear and id(m) not in own
               and (id(m) in adapted or not m.weight.requires_grad)]
    cast = _autocast_dtype(linears[0].weight.device.type) if linears else None
    prepared = {id(m) for m in linears}
    groups = [(g, [_base(m, adapted) for m in g]) for g in fuse] if pack else []
    groups = [(g, bases) for g, bases in groups
              if all(b is not None and id(b) in prepared for b in bases)]
    group_of = {id(b): i for i, (_, bases) in enumerate(groups) for b in bases}
    undo: list[Any] = []
    packed, weights, fused = 0, {}, {}
    try:
        with torch.no_grad():
            for module in linears:
                weight = module.weight.data
                layer = adapted.get(id(module))
                if layer is not None:
                    delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters
                                if a in layer.lora_A)
                    weight = weight + delta.to(weight.dtype)
                if cast is not None and weight.dtype != cast:
                    weight = weight.to(cast)
                if id(module) in group_of:
                    # a group is packed as soon as its last member is ready, so at most one
                    # group's unpacked copies are alive at a time
                    group, bases = groups[group_of[id(module)]]
                    weights[id(module)] = weight
                    if all(id(b) in weights for b in bases):
                        packed += _prepare_group(group, [(b, weights.pop(id(b))) for b in bases],
                                                 undo, fused, adapted)
                else:
                    packed += _prepare(module, weight, pack, undo, shared=layer is None)
        with (teacher_mode(model) if layers else torch.no_grad(),
              model.disable_adapter() if layers else contextlib.nullcontext()):
            yield DecodeWeights(folded=bool(layers), packed=packed, fused=fused)
    finally:
        for restore in reversed(undo):
            restore()


def packable(weight: torch.Tensor) -> bool:
    """Whether oneDNN can run a linear layer with this weight: a CPU tensor, float32 or (on a CPU
    with native bf16) bfloat16, and a PyTorch built with oneDNN."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32


def _install_packed(module: torch.nn.Linear, weight: torch.Tensor) -> Any:
    """Route `module`'s forward through a oneDNN-packed copy of `weight`; returns the undo."""
    bias = None if module.bias is None else module.bias.detach().to(weight.dtype)
    # the row count is only a layout hint; decode steps have one row per sequence
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 8)
    module.forward = functools.partial(_packed_linear, packed=packed, bias=bias,
                                       dtype=weight.dtype)
    return lambda: delattr(module, "forward")


def _base(module: Any, adapted: dict[int, Any]) -> torch.nn.Linear | None:
    """The linear layer a fused group member runs as: itself, or a LoRA layer's base layer when
    its update is folded in (None: an unfolded LoRA layer, whose adapter must run)."""
    if type(module) is torch.nn.Linear:
        return module
    base = module.get_base_layer() if hasattr(module, "get_base_layer") else None
    return base if base is not None and adapted.get(id(base)) is module else None


def _prepare(module: torch.nn.Linear, weight: torch.Tensor, pack: bool, undo: list[Any], *,
             shared: bool) -> int:
    """Make `module` run with its prepared `weight`: packed when it can be, else swapped in
    (nothing when it is the module's own). Appends the undo; returns 1 when packed, else 0.
    `shared`: the module's Parameter may be shared with another module (`_swap_weight`)."""
    # a module whose forward is already an instance attribute (accelerate's device-map hooks)
    # keeps it: its undo would remove theirs
    if pack and packable(weight) and "forward" not in vars(module):
        undo.append(_install_packed(module, weight))
        return 1
    if weight is not module.weight.data:
        undo.append(_swap_weight(module, weight, param_shared=shared))
    return 0


def _prepare_group(group: tuple[Any, ...], members: list[tuple[torch.nn.Linear, torch.Tensor]],
                   undo: list[Any], fused: dict[tuple[int, ...], Any],
                   adapted: dict[int, Any]) -> int:
    """Fuse a group's (base layer, prepared weight) `members` into one packed weight
    (`fused[ids of group]` = the call) when they can share one, else prepare each as any other
    layer. Appends the undos; returns how many members run on packed weights."""
    if (len({w.dtype for _, w in members}) == 1 and packable(members[0][1])
            and len({b.bias is None for b, _ in members}) == 1
            and all("forward" not in vars(b) for b, _ in members)):
        fused[tuple(id(m) for m in group)] = _install_fused(members, undo)
        return len(members)
    return sum(_prepare(b, w, True, undo, shared=id(b) not in adapted) for b, w in members)


def _install_fused(members: list[tuple[torch.nn.Linear, torch.Tensor]], undo: list[Any],
                   ) -> Callable[[torch.Tensor], torch.Tensor]:
    """Pack [W₁; W₂; …] of the (module, prepared weight) `members` once; returns the fused call
    and appends the members' undos (each member, called alone, slices its rows of the fused
    output)."""
    weight = torch.cat([w for _, w in members])
    first = members[0][0]
    bias = None if first.bias is None else torch.cat(
        [b.bias.detach() for b, _ in members]).to(weight.dtype)
    call = functools.partial(_packed_linear, packed=torch.ops.mkldnn._reorder_linear_weight(
        weight, 8), bias=bias, dtype=weight.dtype)
    start = 0
    for base, w in members:
        base.forward = functools.partial(_slice_of, call=call, start=start, stop=start + len(w))
        undo.append(functools.partial(delattr, base, "forward"))
        start += len(w)
    return call


def _slice_of(x: torch.Tensor, *, call: Any, start: int, stop: int) -> torch.Tensor:
    return call(x)[..., start:stop]


def _packed_linear(x: torch.Tensor, *, packed: torch.Tensor, bias: torch.Tensor | None,
                   dtype: torch.dtype) -> torch.Tensor:
    """y = x·Wᵀ + b with a packed W; the input is cast to W's dtype as autocast would."""
    return torch.ops.mkldnn._linear_pointwise(x.to(dtype), packed, bias, "none", [], "")


def _swap_weight(module: torch.nn.Linear, weight: torch.Tensor, *, param_shared: bool) -> Any:
    """Make `weight` the module's weight for the block; returns the undo. A layer that may share
    its Parameter with another module (the output head with the input embedding) gets a new
    Parameter, so the other module keeps its own dtype; a LoRA base layer swaps `.data`."""
    if param_shared:
        old = module.weight
        module.weight = torch.nn.Parameter(weight, requires_grad=False)

        def undo() -> None:
            module.weight = old
    else:
        old_data = module.weight.data
        module.weight.data = weight

        def undo() -> None:
            module.weight.data = old_data
    return undo


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs linear layers in on `device_type`, or None when it is off."""
    if not torch.is_autocast_enabled(device_type):
        return None
    return torch.get_autocast_dtype(device_type)


def _adapter_sublayers(model: Any) -> set[int]:
    """ids of the LoRA layers' own A and B modules."""
    from peft.tuners.lora import LoraLayer

    return {id(sub) for m in model.modules() if isinstance(m, LoraLayer)
            for part in (m.lora_A, m.lora_B) for sub in part.values()}


def _lora_layers(model: Any) -> list[Any]:
    """The model's LoRA layers, or [] when folding them would not be exact."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    for layer in layers:
        active = [a for a in layer.active_adapters if a in layer.lora_A]
        if (layer.merged or layer.disable_adapters or not active
                or any(layer.use_dora.get(a, False) for a in active)
                or not isinstance(getattr(layer.get_base_layer(), "weight", None),
                                  torch.nn.Parameter)):
            return []
    return layers


@contextlib.contextmanager
def frozen_weights_in(model: Any, dtype: torch.dtype | None) -> Iterator[int]:
    """Run the block with every frozen linear layer's weight stored in `dtype` (None: nothing
    changes); yields how many layers were switched. For forward and backward passes under an
    autocast to `dtype`: autocast rounds a float32 weight to `dtype` at each call, but caches
    the rounded copy only for weights that require gradients — a frozen weight is rounded
    again in every forward (the teacher's, each student micro-batch's). Rounding it once for
    the block gives the same values, so the same function. Each module gets a new Parameter
    (not new `.data`): a backward after the block still finds the tensors its forward used,
    and a weight shared with another module (the output head with the input embedding) stays
    float32 there. Memory: one `dtype` copy of the frozen weights while the block runs."""
    if dtype is None:
        yield 0
        return
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear
               and not m.weight.requires_grad and m.weight.dtype != dtype]
    undo = [_swap_weight(m, m.weight.detach().to(dtype), param_shared=True) for m in linears]
    try:
        yield len(linears)
    finally:
        for restore in reversed(undo):
            restore()
