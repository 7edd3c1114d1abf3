"""Shared fixtures. Models are expensive on 2 CPU cores: the real default model is loaded once per
session; tests that need *a* model and not *the* model build a tiny random one from a config."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download anything
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(scope="session")
def default_dir() -> str:
    """The converted default model directory (converted on first use, then cached)."""
    from selfdistill.models import default_model_dir

    return str(default_model_dir(progress=False))


@pytest.fixture(scope="session")
def tokenizer(default_dir):
    """The default model's real tokenizer (SmolLM2, vocabulary 49152, ChatML template)."""
    from selfdistill.models import load_tokenizer

    return load_tokenizer(default_dir)


@pytest.fixture(scope="session")
def default_model(default_dir):
    """The real default model (SmolLM2-135M-Instruct, float32), shared by the whole session.
    Tests must not modify its weights; wrap it (e.g. with a LoRA adapter) on a deep copy."""
    from selfdistill.models import load_model

    return load_model(default_dir, progress=False)


def make_tiny_model(vocab_size: int = 49152, *, seed: int = 0, hidden: int = 32, layers: int = 2):
    """A tiny random Llama causal LM (no download) whose vocabulary matches the real tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
        max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = LlamaForCausalLM(cfg)
    model.eval()
    return model


def save_tiny_model(directory, tokenizer, *, seed: int = 0) -> str:
    """Save a tiny random model (see `make_tiny_model`) with `tokenizer` as an HF directory."""
    make_tiny_model(hidden=32, layers=2, seed=seed).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, tokenizer) -> str:
    """A tiny random model directory (seed 0) with the real tokenizer, shared by the session."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny_model"), tokenizer)


@pytest.fixture
def tiny_model():
    """A fresh tiny random model for each test (seed 0)."""
    return make_tiny_model()


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and the machine is shared: a module opts in with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
