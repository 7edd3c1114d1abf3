"""Rollout backends: seeded sampling that does not depend on the batch around a sample, the lag
correction from the sampler's log-probs, and training against a real `selfdistill serve` process
(the same code path as a vLLM server: /v1/completions with token log-probs, runtime LoRA)."""

from __future__ import annotations

import functools
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from selfdistill.errors import UserError
from selfdistill.rollout import generate
from selfdistill.rollout.seeding import GumbelSampler, sample_seed
from selfdistill.rollout.server import ServerSampler
from selfdistill.train.methods import Sample, start_policy
from tests.serve_world import free_port
from tests.test_distributed import launch

ROOT = Path(__file__).resolve().parent.parent
KNOWLEDGE = ROOT / "examples" / "knowledge.yaml"


def test_a_seeded_completion_does_not_depend_on_its_batch(tiny_model, tokenizer):
    prompts = [[1, 504, 3458], [1, 2000, 17, 99, 5], [1, 42], [1, 7, 8, 9]]
    seeds = [sample_seed(0, 3, 0, i) for i in range(4)]
    kw = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.95}
    together = generate(tiny_model, tokenizer, prompts, seeds=seeds, batch_size=4, **kw)
    alone = [generate(tiny_model, tokenizer, [p], seeds=[s], **kw)[0]
             for p, s in zip(prompts[::-1], seeds[::-1], strict=True)][::-1]
    assert [g[0].token_ids for g in together] == [g[0].token_ids for g in alone]
    other = generate(tiny_model, tokenizer, prompts[:1], seeds=[seeds[0] + 1], **kw)
    assert other[0][0].token_ids != together[0][0].token_ids
    # the recorded log-probs are the raw (temperature-1, unfiltered) log-probs of the sampled
    # tokens, also when sampling was tempered
    tempered = generate(tiny_model, tokenizer, prompts[1:2], seeds=seeds[1:2],
                        max_new_tokens=8, temperature=0.6)
    for c in (together[1][0], tempered[0][0]):
        ids = torch.tensor([prompts[1] + c.token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(tiny_model(input_ids=ids).logits[0], -1)
        want = [float(lp[len(prompts[1]) - 1 + i, t]) for i, t in enumerate(c.token_ids)]
        assert len(want) == 8 and c.logprobs == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_shared_system_prompt_is_prefilled_once_with_the_same_result(tiny_model, tokenizer,
                                                                       greedy):
    """Prompts that open with the same system prompt: the batch prefills it once and repeats
    its cache (`rollout.hf`); each row's tokens and log-probs are those it gets alone."""
    from selfdistill.chat import prompt_ids

    system = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
    questions = ["What is the capital of France?", "Name a prime.", "Why is the sky blue?"]
    prompts = [prompt_ids(tokenizer, [system, {"role": "user", "content": q}])
               for q in questions]
    kw = {"max_new_tokens": 6, "greedy": greedy, "temperature": 0.8}
    seeds = None if greedy else [sample_seed(2, 0, 0, i) for i in range(3)]
    together = generate(tiny_model, tokenizer, prompts, seeds=seeds, batch_size=3, **kw)
    alone = [generate(tiny_model, tokenizer, [p], seeds=None if greedy else [seeds[i]], **kw)[0]
             for i, p in enumerate(prompts)]
    for a, b in zip(together, alone, strict=True):
        assert a[0].token_ids == b[0].token_ids
        assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)


def test_gumbel_sampler_draws_from_the_tempered_nucleus():
    """Frequencies over 4000 seeded draws match softmax(z / T) restricted to the top-p nucleus
    (within 4 binomial standard deviations); tokens outside the nucleus never appear."""
    z = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -4.0])
    T, top_p, n = 0.7, 0.9, 4000
    p = torch.softmax(z / T, -1)
    keep = torch.cumsum(p, 0) - p < top_p  # the smallest prefix holding top_p of the mass
    want = torch.where(keep, p, torch.zeros_like(p))
    want = want / want.sum()
    sampler = GumbelSampler([sample_seed(1, 0, 0, i) for i in range(n)], temperature=T,
                            top_p=top_p)
    draws = sampler(torch.zeros(n, 1, dtype=torch.long), z.expand(n, -1).clone()).argmax(-1)
    freq = torch.bincount(draws, minlength=len(z)).double() / n
    assert not keep.all() and freq[~keep].sum() == 0
    for f, q in zip(freq.tolist(), want.tolist(), strict=True):
        assert abs(f - q) <= 4 * math.sqrt(q * (1 - q) / n) + 1e-9


def test_lagged_samples_are_corrected_from_the_samplers_logprobs():
    row = SimpleNamespace(answers=[])
    fresh = Sample(0, row, 0, [1], [5, 6, 7], behaviour_logprobs=[-1.0, -2.0, -3.0])
    lagged = Sample(1, row, 1, [1], [5, 6, 7], behaviour_logprobs=[-1.5, math.nan, -0.5],
                    lag=2)
    logp = torch.tensor([[-1.01, -2.0, -3.02], [-1.0, -1.0, -1.0]])
    m = start_policy([fresh, lagged], logp)
    assert fresh.old_logprobs.tolist() == pytest.approx([-1.01, -2.0, -3.02])  # the learner's
    assert lagged.old_logprobs.tolist() == pytest.approx([-1.5, -1.0, -0.5])  # NaN → learner
    assert m["sampler_lag"] == 1.0
    assert m["sampler_logprob_absdiff"] == pytest.approx(0.01, abs=1e-6)  # unlagged rows only


def test_an_unreachable_server_is_one_clear_error(tokenizer, tmp_path):
    sampler = ServerSampler(f"http://127.0.0.1:{free_port()}", tokenizer, push_dir=tmp_path,
                            timeout=5)
    with pytest.raises(UserError, match=r"unreachable .*rollout.url"):
        sampler.call("/v1/completions", {"model": "x", "prompt": [1]})


@pytest.fixture(scope="module")
def serve_process(tiny_dir, tmp_path_factory):
    """`selfdistill serve` on the tiny model in its own process, runtime LoRA loading on."""
    home, port = tmp_path_factory.mktemp("serve_home"), free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    log = open(home / "server.log", "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "selfdistill", "--quiet", "serve",
                             f"model={tiny_dir}", f"home={home}", f"port={port}", "threads=1",
                             "lora_updates=true", "learner.enabled=false"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2):
                break
        except OSError:
            if proc.poll() is not None or time.time() > deadline:
                proc.kill()
                pytest.fail("selfdistill serve did not start:\n" +
                            (home / "server.log").read_text()[-2000:])
            time.sleep(0.3)
    yield SimpleNamespace(url=url, home=home)
    proc.terminate()
    proc.wait(30)
    log.close()


def _models(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return [m["id"] for m in json.load(r)["data"]]


def test_two_ranks_sample_from_a_real_server_and_push_the_adapter(serve_process, tiny_dir,
                                                                   tmp_path, tokenizer):
    run = tmp_path / "run"
    res = launch(2, "train", str(KNOWLEDGE), f"model={tiny_dir}", f"output_dir={run}",
                 "steps=3", "batch_size=2", "max_new_tokens=6", "eval.max_new_tokens=2",
                 "eval.oracle=false", "probe_data=null", "checkpoint_every=0", "threads=1",
                 "rollout.backend=server", f"rollout.url={serve_process.url}",
                 "rollout.push_every=2", "rollout.concurrency=2", "precision=float32")
    assert res.returncode == 0, res.stderr[-3000:]
    # versions 0 and 2 were pushed (push_every=2); the server now serves only the newest
    pushed = sorted(p.name for p in (run / "pushed").iterdir())
    assert pushed == ["selfdistill-step000000", "selfdistill-step000002"]
    served = _models(serve_process.url)
    assert "selfdistill-step000002" in served and "selfdistill-step000000" not in served
    m = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    # step 2 sampled from version 0 (lag 1): corrected with the server's log-probs; steps 1
    # and 3 sampled from the learner's own weights: the server's log-probs equal the learner's
    assert [x["sampler_lag"] for x in m] == [0.0, 1.0, 0.0]
    for x in (m[0], m[2]):
        assert x["sampler_logprob_absdiff"] < 1e-4
    assert "sampler_logprob_absdiff" not in m[1]
    # completions carry the version they were sampled with
    sampler = ServerSampler(serve_process.url, tokenizer, push_dir=run / "pushed",
                            push_every=2)
    sampler.sync(None, 3)  # version 2 exists on disk: reloaded under a new load call
    (c,), = sampler.sample([[1, 504, 3458]], n=1, max_new_tokens=4, temperature=1.0, top_p=1.0,
                           seeds=[5])
    assert c.meta == {"adapter": "selfdistill-step000002", "adapter_version": 2}
    assert len(c.logprobs) == len(c.token_ids) and all(v <= 0 for v in c.logprobs)


def _tiny_qwen2(seed: int = 0, **config):
    """A tiny random Qwen2 causal LM (q/k/v with biases) on the real tokenizer's vocabulary."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=49152, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, tie_word_embeddings=True, bos_token_id=1,
                      eos_token_id=2, pad_token_id=2, **config)
    model = Qwen2ForCausalLM(cfg)
    for name, p in model.named_parameters():
        if name.endswith("bias"):  # zero at init: random, so the biases count in the test
            p.data = torch.randn(p.shape) * 0.5
    return model.eval()


def _tiny_lora(seed: int = 0, arch: str = "llama"):
    from peft import LoraConfig, get_peft_model

    from tests.conftest import make_tiny_model

    base = make_tiny_model(seed=seed) if arch == "llama" else _tiny_qwen2(seed=seed)
    model = get_peft_model(base, LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # B = 0 at init would make the adapter (and the test) a no-op
            p.data = torch.randn(p.shape, generator=gen) * 0.5
    return model


def test_folded_lora_generation_is_the_same_function_and_restores_the_model(tokenizer):
    """Decoding through W + s·B·A gives the tokens and log-probs of decoding through PEFT's
    layers; afterwards every parameter is bit-identical, trainable flags and the adapter are
    back (a forward equals the one before), and a disabled adapter is not folded in."""
    from selfdistill.rollout.weights import decode_weights

    model = _tiny_lora()
    prompts = [[1, 504, 3458], [1, 2000, 17, 99, 5], [1, 42]]
    seeds = [sample_seed(0, 1, 0, i) for i in range(3)]
    ids = torch.tensor([[1, 504, 3458, 17]])
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        logits_before = model(input_ids=ids).logits
        with model.disable_adapter():
            base_logits = model(input_ids=ids).logits
    kw = {"max_new_tokens": 12, "temperature": 1.0, "seeds": seeds}
    plain = generate(model, tokenizer, prompts, fold_lora=False, **kw)
    folded = generate(model, tokenizer, prompts, fold_lora=True, **kw)
    assert [g[0].token_ids for g in folded] == [g[0].token_ids for g in plain]
    for f, p in zip(folded, plain, strict=True):
        assert f[0].logprobs == pytest.approx(p[0].logprobs, abs=1e-4)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, logits_before)
        with decode_weights(model, pack=False) as dw:  # the adapter's function, without its layers
            assert dw.folded and dw.packed == 0
            assert torch.allclose(model(input_ids=ids).logits, logits_before, atol=1e-4)
        with model.disable_adapter(), decode_weights(model, pack=False) as dw:
            assert not dw.folded  # the base model was asked for: nothing to fold
            assert torch.equal(model(input_ids=ids).logits, base_logits)
    # the adapter changes the function, so "same tokens" above compared something real
    assert not torch.allclose(base_logits, logits_before, atol=1e-3)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                    reason="this PyTorch build has no oneDNN: decoding is never packed")
def test_packed_decoding_is_the_same_function_and_leaves_the_model_as_it_was(tokenizer,
                                                                            monkeypatch):
    """oneDNN-packed frozen weights (the CPU default) decode the tokens and log-probs of
    PyTorch's matmul, LoRA folded or not; only frozen linear layers are packed (the adapter's
    own stay as they are); on exit no module keeps a forward override and no parameter moved."""
    from selfdistill.rollout import weights

    calls = []
    real = weights._packed_linear
    monkeypatch.setattr(weights, "_packed_linear", lambda x, **kw: calls.append(1) or real(x, **kw))
    model = _tiny_lora(seed=2)
    prompts = [[1, 504, 3458], [1, 2000, 17, 99, 5], [1, 42]]
    kw = {"max_new_tokens": 12, "temperature": 1.0,
          "seeds": [sample_seed(3, 0, 0, i) for i in range(3)]}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    frozen = [m for m in linears if not m.weight.requires_grad]  # base layers and the head
    assert 0 < len(frozen) < len(linears)
    ids = torch.tensor([[1, 504, 3458, 17]])
    with torch.no_grad(), model.disable_adapter():
        base_logits = model(input_ids=ids).logits
    with model.disable_adapter(), weights.decode_weights(model, fold=False) as dw:
        assert not dw.folded and dw.packed == len(frozen)
        assert all("forward" in vars(m) for m in frozen)
        assert not any("forward" in vars(m) for m in linears if m not in frozen)
        packed_logits = model(input_ids=ids).logits
    assert len(calls) == len(frozen)  # every frozen layer ran through oneDNN, once
    assert torch.allclose(packed_logits, base_logits, atol=1e-5)
    for fold in (True, False):
        calls.clear()
        packed = generate(model, tokenizer, prompts, fold_lora=fold, **kw)
        assert calls
        calls.clear()
        plain = generate(model, tokenizer, prompts, fold_lora=fold, pack_weights=False, **kw)
        assert not calls
        assert [g[0].token_ids for g in packed] == [g[0].token_ids for g in plain]
        for a, b in zip(packed, plain, strict=True):
            assert a[0].logprobs == pytest.approx(b[0].logprobs, abs=1e-4)
    assert not any("forward" in vars(m) for m in linears)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_projections_compute_each_members_output(arch):
    """`decode_weights(fuse=)` packs each layer's (q, k, v) and (gate, up) as one weight: the
    fused call is the members' outputs side by side (q/k/v biases included), a member called
    alone gives its own output, only folded or frozen members are fused (an active adapter
    must run), and on exit no module keeps a forward override and no parameter moved."""
    from selfdistill.rollout import llama_decode, weights

    model = _tiny_lora(seed=2, arch=arch)
    groups = llama_decode.fusable(model)
    assert len(groups) == 2 * model.config.num_hidden_layers
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    h = torch.randn(3, 2, model.config.hidden_size)
    with torch.no_grad():
        with weights.decode_weights(model, pack=False):  # folded, not fused: the reference
            ref = [[m(h) for m in g] for g in groups]
        with weights.decode_weights(model, fuse=groups) as dw:
            assert dw.folded and len(dw.fused) == len(groups)
            for g, outs in zip(groups, ref, strict=True):
                whole = dw.fused[tuple(id(m) for m in g)](h)
                assert torch.allclose(whole, torch.cat(outs, dim=-1), atol=1e-5)
                for m, out in zip(g, outs, strict=True):  # a member alone: its slice
                    assert torch.allclose(m.get_base_layer()(h), out, atol=1e-5)
        with weights.decode_weights(model, fold=False, fuse=groups) as dw:
            assert not dw.fused  # PEFT's layers run their adapters: nothing to fuse
        # a member with a forward of its own (accelerate's hooks): its group is not fused, it
        # keeps that forward (with the folded weight swapped in), its siblings are packed
        hooked = groups[0][1].get_base_layer()
        hook = functools.partial(torch.nn.Linear.forward, hooked)
        hooked.forward = hook
        with weights.decode_weights(model, fuse=groups) as dw:
            assert len(dw.fused) == len(groups) - 1 and hooked.forward is hook
            assert all("forward" in vars(m.get_base_layer()) for m in groups[0])
            for m, out in zip(groups[0], ref[0], strict=True):
                assert torch.allclose(m.get_base_layer()(h), out, atol=1e-5)
        assert hooked.forward is hook
        del hooked.forward
    assert not any("forward" in vars(m) for m in model.modules())
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_the_rollout_config_reaches_generate(tiny_model, tokenizer, monkeypatch):
    """`rollout.fold_lora` / `pack_weights` / `decode_loop` from a job's config are the flags
    the in-process sampler decodes with (`make_sampler`, as the trainer builds it)."""
    from selfdistill.rollout import base
    from selfdistill.train.config import RolloutConfig

    seen = []
    monkeypatch.setattr(base, "generate", lambda *a, **kw: seen.append(
        (kw["fold_lora"], kw["pack_weights"], kw["decode_loop"])) or [])
    flags = [(True, False, True), (False, True, False), (True, True, False)]
    for fold, pack, loop in flags:
        rollout = RolloutConfig(fold_lora=fold, pack_weights=pack, decode_loop=loop)
        sampler = base.make_sampler(rollout, tiny_model, tokenizer, "unused")
        sampler.sync(tiny_model, 0)
        sampler.sample([[1, 42]], n=1, max_new_tokens=2, temperature=1.0, top_p=1.0, seeds=[0])
    assert seen == flags


def test_the_static_decode_cache_gives_what_the_dynamic_cache_gives(tiny_model, tokenizer,
                                                                  monkeypatch):
    """`decode_cache` (preallocated keys/values, shared prefix copied into every row) decodes
    the tokens and log-probs of HF's growing DynamicCache, rows of unequal length included."""
    from transformers import StaticCache

    from selfdistill.chat import prompt_ids
    from selfdistill.rollout import hf

    system = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
    prompts = [prompt_ids(tokenizer, [system, {"role": "user", "content": q}])
               for q in ["Name a prime.", "Why is the sky blue, in one short sentence?"]]
    assert len(prompts[0]) != len(prompts[1])  # the shorter row is padded after the prefix
    prompts.append([1, 504, 3458])  # no shared prefix with the others: a batch of its own
    seeds = [sample_seed(5, 0, 0, i) for i in range(3)]
    kw = {"max_new_tokens": 10, "temperature": 1.0, "seeds": seeds, "batch_size": 2}
    ids = torch.tensor([prompts[0][:4]] * 2)
    assert isinstance(hf.decode_cache(tiny_model, ids, 3, 10), StaticCache)
    static = generate(tiny_model, tokenizer, prompts, **kw)
    monkeypatch.setattr(hf, "decode_cache", lambda *a: None)
    dynamic = generate(tiny_model, tokenizer, prompts, **kw)
    for s, d in zip(static, dynamic, strict=True):
        assert s[0].token_ids == d[0].token_ids
        assert s[0].logprobs == pytest.approx(d[0].logprobs, abs=1e-5)


def test_folded_weights_are_stored_in_the_autocast_dtype_with_the_same_result(tokenizer,
                                                                            monkeypatch):
    """Under bf16 autocast the folded W' and the output head are kept in bf16 (autocast would
    round them to bf16 at every matmul anyway): bit-identical tokens and log-probs to casting
    at every step; afterwards the float32 weights are back and a tied head is tied again."""
    from selfdistill.rollout import weights

    model = _tiny_lora(seed=1)
    prompts = [[1, 504, 3458], [1, 2000, 17, 99, 5]]
    # unpacked: on a CPU with native bf16 the packed path would hold the bf16 copies instead
    kw = {"max_new_tokens": 10, "temperature": 1.0, "seeds": [11, 12], "pack_weights": False}
    seen: list[torch.dtype] = []
    layer = next(m for m in model.modules() if hasattr(m, "lora_A")).get_base_layer()
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    head.weight = embed.weight  # tied, as in the default model
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with weights.decode_weights(model, pack=False):
            seen += [layer.weight.dtype, head.weight.dtype, embed.weight.dtype]
        cast = generate(model, tokenizer, prompts, **kw)
        monkeypatch.setattr(weights, "_autocast_dtype", lambda device_type: None)
        plain = generate(model, tokenizer, prompts, **kw)
    assert seen == [torch.bfloat16, torch.bfloat16, torch.float32]
    assert layer.weight.dtype == torch.float32 and head.weight is embed.weight
    assert [g[0].token_ids for g in cast] == [g[0].token_ids for g in plain]
    assert [g[0].logprobs for g in cast] == [g[0].logprobs for g in plain]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("fold", [True, False])
def test_the_decode_loop_gives_what_generate_gives(tokenizer, monkeypatch, fold, arch):
    """`llama_decode.decode` (the layers run directly, its own prefill included) decodes the
    tokens and log-probs of HF `generate` on the same static cache, for each architecture it
    runs: greedy and seeded, through folded LoRA with fused projections or PEFT's layers, rows
    of unequal length (left padding) after a shared system prompt,
    a row that stops early (its stop token, then nothing) and a batch that ends before
    `max_new_tokens`."""
    from selfdistill.chat import prompt_ids
    from selfdistill.rollout import hf, llama_decode

    model = _tiny_lora(seed=2, arch=arch)
    assert llama_decode.supports(model)
    system = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
    prompts = [prompt_ids(tokenizer, [system, {"role": "user", "content": q}])
               for q in ["Name a prime.", "Why is the sky blue, in one short sentence?",
                         "Say hi."]]
    seeds = [sample_seed(3, 0, 0, i) for i in range(3)]
    calls = {"loop": 0, "fused": 0}
    loop = llama_decode.decode

    def counted(*a, **k):
        calls["loop"] += 1
        calls["fused"] = len(k["fused"])
        return loop(*a, **k)

    monkeypatch.setattr(llama_decode, "decode", counted)
    kw = {"max_new_tokens": 12, "fold_lora": fold}
    for case in ({"seeds": seeds, "temperature": 0.7}, {"greedy": True}):
        first = generate(model, tokenizer, prompts, **case, **kw)
        # the third token row 0 decodes becomes a stop token: that row (and any row that
        # decodes it) stops there, the others go on
        stop = first[0][0].token_ids[2]
        monkeypatch.setattr(hf, "eos_ids", lambda m, t, s=stop: [tokenizer.eos_token_id, s])
        before = calls["loop"]
        ours = generate(model, tokenizer, prompts, **case, **kw)
        assert calls["loop"] == before + 1  # one batch, through the loop
        # with LoRA folded, through (q, k, v) and (gate, up) fused; PEFT's layers one by one
        assert calls["fused"] == (2 * model.config.num_hidden_layers if fold else 0)
        ref = generate(model, tokenizer, prompts, decode_loop=False, **case, **kw)
        assert calls["loop"] == before + 1  # the reference is HF generate
        monkeypatch.undo()
        monkeypatch.setattr(llama_decode, "decode", counted)
        assert ours[0][0].token_ids == first[0][0].token_ids[:3] and ours[0][0].finished
        assert any(len(g[0].token_ids) == 12 for g in ref)  # and some row ran to the limit
        for o, r in zip(ours, ref, strict=True):
            assert o[0].token_ids == r[0].token_ids and o[0].finished == r[0].finished
            assert o[0].logprobs == pytest.approx(r[0].logprobs, abs=1e-5)
    # the batch stops when every row is done: one stop token per row, decoded first
    monkeypatch.setattr(hf, "eos_ids", lambda m, t: sorted(
        {tokenizer.eos_token_id} | {g[0].token_ids[0] for g in ref}))
    short = generate(model, tokenizer, prompts, greedy=True, **kw)
    assert [len(g[0].token_ids) for g in short] == [1, 1, 1]
    monkeypatch.undo()
    # one row: no shared prefix, the loop's prefill fills (and allocates) the whole cache
    one, one_ref = (generate(model, tokenizer, prompts[1:2], greedy=True, decode_loop=d, **kw)
                    for d in (True, False))
    assert one[0][0].token_ids == one_ref[0][0].token_ids
    assert one[0][0].logprobs == pytest.approx(one_ref[0][0].logprobs, abs=1e-5)


def test_a_generation_config_with_its_own_processors_goes_through_generate():
    """A repetition penalty (or any processor `generate` would add from the model's generation
    config) is not something the loop applies, nor sliding-window attention: such a model
    decodes through `generate`."""
    from selfdistill.rollout import llama_decode
    from tests.conftest import make_tiny_model

    model = make_tiny_model(seed=0)
    assert llama_decode.supports(model)
    model.generation_config.repetition_penalty = 1.3
    assert not llama_decode.supports(model)
    # sliding-window attention is not what the loop computes: generate
    assert not llama_decode.supports(_tiny_qwen2(use_sliding_window=True, sliding_window=8,
                                                 max_window_layers=0))
