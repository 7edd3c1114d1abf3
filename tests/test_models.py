"""The embedded default model: GGUF conversion, the cache, and model/adapter path errors."""

from __future__ import annotations

import time

import pytest
import torch

from selfdistill import models
from selfdistill.errors import UserError


def test_conversion_is_cached_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SELFDISTILL_CACHE", str(tmp_path / "cache"))
    t0 = time.perf_counter()
    first = models.load_model(progress=False)
    t_first = time.perf_counter() - t0
    target = tmp_path / "cache" / "models" / models.DEFAULT_MODEL
    assert (target / "model.safetensors").is_file()
    assert (target / "selfdistill-cache.json").is_file()
    # No half-written temporary conversion directory is left beside the cache.
    assert not [p for p in target.parent.iterdir()
                if p.is_dir() and p.name.startswith(f".{target.name}.")]
    stamp = (target / "model.safetensors").stat().st_mtime_ns

    t0 = time.perf_counter()
    second = models.load_model(progress=False)
    t_second = time.perf_counter() - t0
    assert (target / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    assert t_second < t_first / 2, (t_first, t_second)
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, second.model(ids).logits)
    assert first.model.config.vocab_size == 49152
    assert second.tokenizer.eos_token == "<|im_end|>"


def test_cache_location_respects_env(monkeypatch, tmp_path):
    monkeypatch.delenv("SELFDISTILL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert models.cache_dir() == tmp_path / "selfdistill"
    monkeypatch.setenv("SELFDISTILL_CACHE", str(tmp_path / "x"))
    assert models.cache_dir() == tmp_path / "x"


def test_default_model_answers(default_model):
    from selfdistill.chat import prompt_ids, to_messages
    from selfdistill.rollout import generate

    tok = default_model.tokenizer
    ids = prompt_ids(tok, to_messages("What is the capital of France?"))
    [[c]] = generate(default_model.model, tok, [ids], greedy=True, max_new_tokens=12)
    assert "Paris" in c.text
    assert c.token_ids and len(c.logprobs) == len(c.token_ids)
    assert all(lp <= 0 for lp in c.logprobs)


def test_any_hf_directory_loads(tmp_path, tokenizer):
    from tests.conftest import make_tiny_model

    make_tiny_model().save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    lm = models.load_model(str(tmp_path), progress=False)
    assert lm.path == str(tmp_path)
    assert lm.model.config.hidden_size == 32


@pytest.mark.parametrize("name, needle", [
    ("/definitely/not/here", "no such directory"),
    ("./relative/missing", "no such directory"),
])
def test_unknown_model_path(name, needle):
    with pytest.raises(UserError, match=needle):
        models.resolve_model(name)


def test_adapter_dir_must_be_peft(tmp_path, tiny_model):
    with pytest.raises(UserError, match="not a PEFT adapter directory"):
        models.load_adapter(tiny_model, tmp_path)
