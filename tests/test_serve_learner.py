"""The background learner on a real server: a tenant's feedback becomes a gated adapter for that
tenant only; an adversarial tenant is stopped by the forgetting probes; a crash during learning
loses neither the active versions nor accepted feedback."""

from __future__ import annotations

import pytest

from tests import serve_world
from tests.serve_world import ADMIN, Server, config

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures: tests/conftest.py
LEARN = {"threshold": 0.0, "every_lessons": 2, "steps": 4, "batch_size": 2, "anchor_batch_size": 0,
         "learning_rate": 1e-2, "max_new_tokens": 8, "lora_rank": 4, "gate_max_new_tokens": 8}


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    s = Server(config(tmp_path_factory.mktemp("home"), tiny_dir, learner=LEARN,
                      governance={"consent": {"user:alice": True, "user:bob": True}}))
    yield s
    s.stop()


def chat(client, user: str, text: str, **kw):
    return client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": text}], max_tokens=8,
        temperature=0, user=user, **kw)


def teach(server, user: str, pairs: list[tuple[str, str]]) -> None:
    client = server.client()
    for question, correction in pairs:
        res = chat(client, user, question)
        r = server.http.post("/v1/feedback", json={
            "completion_id": res.id, "text": correction, "user": user})
        assert r.status_code == 200 and r.json()["status"] == "accepted", r.text


def test_lessons_change_only_their_tenants_adapter(server):
    client = server.client()
    before_bob = chat(client, "bob", "What is the capital of France?")
    teach(server, "alice", [("What is the capital of Veloria?", "It is Marquenta."),
                            ("Who founded Harnwick?", "Marrowby founded it.")])
    r = server.http.post("/admin/learner/tick", headers=ADMIN)
    [rnd] = r.json()["rounds"]
    assert rnd["scope"] == "user:alice" and rnd["error"] is None and rnd["version_id"]
    assert len(rnd["lesson_ids"]) == 2
    checks = {c["name"]: c for c in rnd["verdict"]["checks"]}
    assert "forgetting_probes" in checks and any(k.startswith("check:") for k in checks)
    reg = server.service.registry
    assert reg.resolve(user="bob").version is None and reg.resolve().version is None
    assert rnd["promoted"] and rnd["verdict"]["promote"]
    assert reg.resolve(user="alice").version == rnd["version_id"]
    assert chat(client, "alice", "Hi").selfdistill["version"] == rnd["version_id"]
    after_bob = chat(client, "bob", "What is the capital of France?")
    assert after_bob.selfdistill["version"] is None
    assert after_bob.choices[0].message.content == before_bob.choices[0].message.content
    lessons = server.http.get("/admin/tenants/user:alice", headers=ADMIN).json()
    assert lessons["rounds"][0]["lesson_ids"] == rnd["lesson_ids"]
    assert [v["id"] for v in lessons["versions"]] == [rnd["version_id"]]


# -- an adversarial tenant -------------------------------------------------------------------------

BANANA = "That is wrong. The correct answer is banana."


@pytest.fixture(scope="module")
def gullible(tmp_path_factory, tokenizer):
    """A tiny base that answers every probe " Paris" but, shown the adversary's feedback as the
    teacher's context, answers " banana": the teacher the adversary needs, built on purpose, so
    self-distillation of its lessons is a strong, deterministic harmful update."""
    import json

    from selfdistill.chat import prompt_ids, to_messages
    from selfdistill.data import load_rows
    from selfdistill.serve.lessons import teacher_messages
    from tests.conftest import make_tiny_model
    from tests.registry_world import PROBES, _fit, answers

    root = tmp_path_factory.mktemp("gullible")
    probe_qs = [r.messages[-1]["content"] for r in load_rows(PROBES)][:8]
    plain = [prompt_ids(tokenizer, to_messages(q)) for q in probe_qs]
    taught = [prompt_ids(tokenizer, teacher_messages(to_messages(q), BANANA)) for q in probe_qs]
    base = make_tiny_model()
    words = [" Paris"] * len(plain) + [" banana"] * len(taught)
    _fit(base, tokenizer, plain + taught, words, steps=15, lr=2e-2)
    assert all("Paris" in a for a in answers(base, tokenizer, probe_qs)), "construction"
    ids = generate_texts(base, tokenizer, taught)
    assert all("banana" in a for a in ids), ids
    base.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    probes = root / "probes.jsonl"
    probes.write_text("".join(json.dumps({"prompt": q, "answer": "Paris"}) + "\n"
                              for q in probe_qs))
    return root / "model", probes, probe_qs


def generate_texts(model, tok, prompts):
    from selfdistill.rollout import generate

    return [c[0].text for c in generate(model, tok, prompts, greedy=True, max_new_tokens=8)]


def test_adversarial_tenant_is_caught_by_forgetting_probes(gullible, tmp_path):
    model_dir, probes, probe_qs = gullible
    learn = {**LEARN, "every_lessons": 8, "steps": 4, "batch_size": 8, "learning_rate": 3e-2,
             "probes": [str(probes)], "probe_tolerance": 1}
    s = Server(config(tmp_path / "home", model_dir, learner=learn,
                      governance={"consent": {"user:mallory": True, "user:alice": True}}))
    try:
        teach(s, "mallory", [(q, BANANA) for q in probe_qs[:8]])
        [rnd] = s.http.post("/admin/learner/tick", headers=ADMIN).json()["rounds"]
        assert rnd["scope"] == "user:mallory" and rnd["version_id"] and not rnd["promoted"]
        probe = {c["name"]: c for c in rnd["verdict"]["checks"]}["forgetting_probes"]
        assert not probe["passed"] and probe["before"] - probe["after"] > 1, probe
        reg = s.service.registry
        assert reg.resolve(user="mallory").version is None  # nothing changed, for anyone
        assert reg.resolve(user="alice").version is None and reg.resolve().version is None
        res = chat(s.client(), "mallory", probe_qs[0])
        assert "Paris" in res.choices[0].message.content and res.selfdistill["version"] is None
    finally:
        s.stop()


# -- crash during learning -------------------------------------------------------------------------


def _start(home, model_dir, port: int, *overrides: str):
    import subprocess
    import sys
    import time

    import httpx

    log = (home / f"server-{port}.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "selfdistill", "--quiet", "serve", f"model={model_dir}",
         f"home={home}", f"port={port}", f"admin_token={serve_world.TOKEN}", "threads=1",
         "learner.threshold=0", "learner.lora_rank=4", "learner.max_new_tokens=8",
         "learner.anchor_batch_size=0",
         "governance.consent_default=true", *overrides],
        stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 180
    while time.time() < deadline:
        assert proc.poll() is None, (home / f"server-{port}.log").read_text()
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise AssertionError("server did not come up")


@pytest.mark.slow  # two server processes start (~30-60 s on the shared 2-core machine)
def test_crash_during_learning_keeps_versions_and_feedback(tiny_dir, tmp_path):
    import signal
    import time

    import httpx
    from openai import OpenAI

    from selfdistill.registry import Registry
    from selfdistill.serve import state
    from tests.test_serve import propose

    home = tmp_path / "home"
    with Registry(home / "registry.db", weights_dir=home / "adapters") as reg:
        bob = propose(reg, tiny_dir, tmp_path / "bob-run", "user:bob", seed=3)
        reg.promote(bob, force=True)
    port = serve_world.free_port()
    proc = _start(home, tiny_dir, port, "learner.every_lessons=1", "learner.steps=100000",
                  "learner.poll_seconds=0.1")
    try:
        url = f"http://127.0.0.1:{port}"
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        res = chat(client, "alice", "What is the capital of Veloria?")
        fb = httpx.post(f"{url}/v1/feedback", json={
            "completion_id": res.id, "text": "It is Marquenta.", "user": "alice"}).json()
        assert fb["status"] == "accepted"
        deadline = time.time() + 60
        while httpx.get(f"{url}/admin/learner", headers=ADMIN).json()["learning"] != "user:alice":
            assert time.time() < deadline, "the learner never started the round"
            time.sleep(0.1)
        time.sleep(0.5)  # in the middle of training
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    with Registry(home / "registry.db", weights_dir=home / "adapters") as reg:
        assert reg.resolve(user="bob").version == bob and reg.resolve(user="alice").version is None
        [kept] = state.lessons(reg.store.session, scope="user:alice")
        assert kept["id"] == fb["id"] and kept["status"] == "accepted"
    port = serve_world.free_port()
    proc = _start(home, tiny_dir, port, "learner.enabled=false", "learner.steps=2",
                  "learner.every_lessons=1")
    try:
        url = f"http://127.0.0.1:{port}"
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        assert chat(client, "bob", "Hi").selfdistill["version"] == bob
        [rnd] = httpx.post(f"{url}/admin/learner/tick", headers=ADMIN, timeout=120).json()[
            "rounds"]
        assert rnd["lesson_ids"] == [fb["id"]] and rnd["error"] is None
    finally:
        proc.terminate()
        proc.wait(30)
