"""vLLM-compatible endpoints against a real server: /v1/completions with token log-probs (checked
against the model's own forward), seeds, echo / prompt log-probs, streaming, and runtime LoRA
loading and unloading."""

from __future__ import annotations

import json

import pytest
import torch

from selfdistill.models import attach_lora, load_model
from tests.serve_world import Server, config

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures: tests/conftest.py
PROMPT = [1, 504, 3458, 314, 260, 1345, 30]


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    s = Server(config(tmp_path_factory.mktemp("home"), tiny_dir, lora_updates=True))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lora_dir(tiny_dir, tmp_path_factory):
    """A LoRA adapter with random (non-zero) B matrices: it changes the logits."""
    torch.manual_seed(1)
    peft = attach_lora(load_model(str(tiny_dir), progress=False).model, rank=4)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("lora") / "adapter"
    peft.save_pretrained(path)
    return path


def raw_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """log softmax(logits)[token] of each token after `prompt`, from one plain forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
    return [float(lp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


def complete(server, **body):
    r = server.http.post("/v1/completions", json={"model": server.service.model_name, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_logprobs_are_the_models_raw_logprobs_and_seed_reproduces(server, tiny_dir):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "top_p": 0.9, "seed": 7,
            "logprobs": 2, "return_token_ids": True}
    a, b = complete(server, **body), complete(server, **body)
    ca = a["choices"][0]
    assert ca["token_ids"] == b["choices"][0]["token_ids"] and len(ca["token_ids"]) == 6
    assert ca["prompt_token_ids"] == PROMPT and ca["finish_reason"] == "length"
    assert a["usage"] == {"prompt_tokens": 7, "completion_tokens": 6, "total_tokens": 13}
    model = load_model(str(tiny_dir), progress=False).model
    want = raw_logprobs(model, PROMPT, ca["token_ids"])
    assert ca["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-4)
    # top_logprobs: the 2 best plus the sampled token, each with its raw log-prob
    for top, lp in zip(ca["logprobs"]["top_logprobs"], want, strict=True):
        assert 2 <= len(top) <= 3 and max(top.values()) >= lp - 1e-6
    other = complete(server, **{**body, "seed": 8})["choices"][0]["token_ids"]
    assert other != ca["token_ids"]


def test_greedy_text_prompt_equals_token_prompt(server, tiny_dir):
    tok = server.service.engine.tokenizer
    text = "The capital of France is"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    by_text = complete(server, prompt=text, max_tokens=5, temperature=0, return_token_ids=True)
    by_ids = complete(server, prompt=ids, max_tokens=5, temperature=0, return_token_ids=True)
    got = by_text["choices"][0]["token_ids"]
    assert got == by_ids["choices"][0]["token_ids"]
    model = load_model(str(tiny_dir), progress=False).model
    with torch.no_grad():
        greedy = model.generate(torch.tensor([ids]), max_new_tokens=5, do_sample=False,
                                eos_token_id=None, pad_token_id=2)[0, len(ids):].tolist()
    assert got == greedy[: len(got)]


def test_echo_prompt_logprobs_and_batch(server, tiny_dir):
    res = complete(server, prompt=[PROMPT, PROMPT[:4]], max_tokens=0, echo=True, logprobs=0,
                   prompt_logprobs=0)
    first, second = res["choices"]
    lps = first["logprobs"]["token_logprobs"]
    assert lps[0] is None and len(lps) == len(PROMPT) and second["index"] == 1
    model = load_model(str(tiny_dir), progress=False).model
    assert lps[1:] == pytest.approx(raw_logprobs(model, PROMPT[:1], PROMPT[1:]), abs=1e-4)
    assert first["prompt_logprobs"][0] is None
    assert first["prompt_logprobs"][3][str(PROMPT[3])]["logprob"] == pytest.approx(lps[3])


def test_stream_equals_whole(server):
    body = {"prompt": PROMPT, "max_tokens": 5, "seed": 3, "logprobs": 0}
    whole = complete(server, **body)["choices"][0]
    text, lps = "", []
    with server.http.stream("POST", "/v1/completions", json={
            "model": server.service.model_name, "stream": True, **body}) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        c = json.loads(e)["choices"][0]
        text += c["text"]
        lps += (c["logprobs"] or {}).get("token_logprobs", [])
    assert text == whole["text"] and lps == whole["logprobs"]["token_logprobs"]


def test_runtime_lora_load_use_unload(server, lora_dir, tiny_dir):
    r = server.http.post("/v1/load_lora_adapter",
                         json={"lora_name": "student-v1", "lora_path": str(lora_dir)})
    assert r.status_code == 200 and "student-v1" in r.text
    ids = [m["id"] for m in server.http.get("/v1/models").json()["data"]]
    assert ids == [server.service.model_name, "student-v1"]
    again = server.http.post("/v1/load_lora_adapter",
                             json={"lora_name": "student-v1", "lora_path": str(lora_dir)})
    assert again.status_code == 400 and again.json()["error"]["param"] == "lora_name"
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "logprobs": 0,
            "return_token_ids": True}
    r = server.http.post("/v1/completions", json={"model": "student-v1", **body}).json()
    toks, lps = r["choices"][0]["token_ids"], r["choices"][0]["logprobs"]["token_logprobs"]
    peft = load_model(str(tiny_dir), adapter=str(lora_dir), progress=False).model
    assert lps == pytest.approx(raw_logprobs(peft, PROMPT, toks), abs=1e-4)
    base = complete(server, **body)["choices"][0]["logprobs"]["token_logprobs"]
    assert base != pytest.approx(lps, abs=1e-3)  # the adapter is really applied
    # load_inplace: the same name now serves other weights (here: the base's, a zero adapter)
    zero = lora_dir.parent / "zero"
    peft = load_model(str(tiny_dir), progress=False).model
    attach_lora(peft, rank=4).save_pretrained(zero)  # B = 0: exactly the base
    r = server.http.post("/v1/load_lora_adapter", json={
        "lora_name": "student-v1", "lora_path": str(zero), "load_inplace": True})
    assert r.status_code == 200
    swapped = server.http.post("/v1/completions", json={"model": "student-v1", **body}).json()
    assert swapped["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(base, abs=1e-5)
    r = server.http.post("/v1/unload_lora_adapter", json={"lora_name": "student-v1"})
    assert r.status_code == 200
    gone = server.http.post("/v1/completions", json={"model": "student-v1", **body})
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
    assert complete(server, **body)["choices"][0]["logprobs"]["token_logprobs"] == base


def test_lora_errors_and_switch(server, tmp_path):
    bad = server.http.post("/v1/load_lora_adapter",
                           json={"lora_name": "x", "lora_path": str(tmp_path)})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    missing = server.http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"})
    assert missing.status_code == 404
    server.service.cfg.lora_updates = False
    try:
        off = server.http.post("/v1/load_lora_adapter",
                               json={"lora_name": "x", "lora_path": str(tmp_path)})
        assert off.status_code == 404 and off.json()["error"]["code"] == "lora_updates_disabled"
    finally:
        server.service.cfg.lora_updates = True


def test_sample_token_rules():
    from selfdistill.serve.engine import sample_token

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    raw = torch.log_softmax(logits, -1)
    greedy = sample_token(logits, temperature=0, top_p=1.0, generator=None, top_logprobs=2)
    assert greedy.id == 0 and greedy.logprob == pytest.approx(float(raw[0]))
    assert list(greedy.top) == [0, 1]
    # top_p = 0.5 keeps only the first token (mass 0.64 ≥ 0.5): always token 0
    g = torch.Generator().manual_seed(0)
    assert {sample_token(logits, temperature=1.0, top_p=0.5, generator=g).id
            for _ in range(50)} == {0}
    # the reported log-prob is the raw one whatever the temperature
    hot = sample_token(logits, temperature=2.0, top_p=1.0, generator=g)
    assert hot.logprob == pytest.approx(float(raw[hot.id]))
    draws = {sample_token(logits, temperature=1.0, top_p=1.0, generator=g).id for _ in range(200)}
    assert draws == {0, 1, 2, 3}
