"""`selfdistill serve` with the official openai client against a real server: chat (plain and
streaming), the adapter each response names, tenant routing, consent, redaction, rate limits,
feedback scoring, admin auth, deletion with proof, and malformed input."""

from __future__ import annotations

import pytest
from openai import BadRequestError, NotFoundError
from sqlalchemy import func, select

from selfdistill.models import attach_lora, load_model
from selfdistill.registry import Registry
from selfdistill.serve import state
from selfdistill.store.serve_models import ServeCompletion, ServeLesson
from tests.serve_world import ADMIN, Server, config

pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures: tests/conftest.py


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    s = Server(config(tmp_path_factory.mktemp("home"), tiny_dir,
                      learner={"threshold": 0.0},
                      governance={"consent": {"user:carol": True}, "lessons_per_hour": 3}))
    yield s
    s.stop()


def propose(reg: Registry, tiny_dir, run_dir, scope: str, seed: int) -> str:
    """A run directory holding a random LoRA adapter for `scope`, proposed; its version id."""
    import json

    import torch

    torch.manual_seed(seed)
    peft = attach_lora(load_model(str(tiny_dir), progress=False).model, rank=4)
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            p.data.normal_(0, 0.5)
    peft.save_pretrained(run_dir / "adapter")
    (run_dir / "summary.json").write_text(json.dumps({
        "model": str(tiny_dir), "model_path": str(tiny_dir),
        "config": {"model": str(tiny_dir), "scope": scope}, "adapter": str(run_dir / "adapter")}))
    return reg.propose(run_dir, scope=scope)["id"]


def ask(client, text: str, **kw):
    return client.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": text}], max_tokens=6, seed=1, **kw)


def count(server, table, scope: str) -> int:
    with server.service.sessions() as s:
        return s.scalar(select(func.count()).select_from(table).where(table.scope == scope))


def test_chat_plain_and_stream_name_their_adapter(server):
    client = server.client()
    raw = ask(client, "Hello there")
    res = raw.parse()
    assert raw.headers["x-selfdistill-adapter"] == "base"
    assert res.object == "chat.completion" and res.choices[0].message.role == "assistant"
    assert isinstance(res.choices[0].message.content, str) and res.usage.completion_tokens > 0
    assert res.selfdistill == {"tenant": None, "scope": None, "version": None,
                               "order": ["global"], "learning": False}
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hello there"}], max_tokens=6,
        seed=1, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == res.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == res.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
    assert all(c.selfdistill["version"] is None for c in chunks)
    models = client.models.list()
    assert [m.id for m in models.data] == [server.service.model_name]


def test_each_tenant_gets_its_own_adapter(server, tiny_dir, tmp_path):
    reg = server.service.registry
    alice = propose(reg, tiny_dir, tmp_path / "a", "user:alice", seed=1)
    acme = propose(reg, tiny_dir, tmp_path / "w", "workspace:acme", seed=2)
    reg.promote(alice, force=True, reason="test")
    reg.promote(acme, force=True, reason="test")
    client = server.client()
    a, b = ask(client, "Hi", user="alice"), ask(client, "Hi", user="bob")
    w = ask(client, "Hi", user="bob", extra_headers={"X-Selfdistill-Scope": "acme"})
    assert a.headers["x-selfdistill-adapter"] == alice and a.parse().selfdistill["version"] == alice
    assert b.headers["x-selfdistill-adapter"] == "base"
    assert w.parse().selfdistill["scope"] == "workspace:acme"
    assert w.parse().selfdistill["order"] == ["user:bob", "workspace:acme", "global"]
    # the adapter is really applied: alice's greedy tokens differ from the base's
    lp = {who: client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, user=who).choices[0].logprobs.content[0].logprob
        for who in ("alice", "bob")}
    assert lp["alice"] != pytest.approx(lp["bob"], abs=1e-4)


def test_no_consent_nothing_stored(server):
    client = server.client()
    first = ask(client, "My email is dave@example.com").parse()
    convo = [{"role": "user", "content": "My email is dave@example.com"},
             {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "No, that is wrong."}]
    client.chat.completions.create(model="default", messages=convo, max_tokens=2, user="dave")
    assert count(server, ServeCompletion, "user:dave") == 0
    assert count(server, ServeLesson, "user:dave") == 0
    r = server.http.post("/v1/feedback", json={"completion_id": first.id, "text": "bad",
                                               "user": "dave"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "consent_required"
    # opting in makes the next conversation count
    assert server.http.post("/v1/consent", json={"user": "dave", "learning": True}).json()[
        "consent"] is True
    client.chat.completions.create(model="default", messages=convo, max_tokens=2, user="dave")
    assert count(server, ServeLesson, "user:dave") == 1


def test_feedback_is_redacted_scored_and_rate_limited(server):
    client = server.client()
    res = ask(client, "Mail jane.roe@example.org or call +1 (555) 123-4567", user="carol").parse()
    assert res.selfdistill["learning"] is True
    stored = server.service.sessions().get(ServeCompletion, res.id)
    assert "[EMAIL]" in stored.messages[0]["content"] and "[PHONE]" in stored.messages[0]["content"]
    assert "jane.roe" not in stored.messages[0]["content"]
    assert stored.redactions == {"EMAIL": 1, "PHONE": 1}
    body = {"completion_id": res.id, "user": "carol", "rating": -1,
            "text": "Wrong. My card is 4111 1111 1111 1111, IBAN DE89 3704 0044 0532 0130 00"}
    fb = server.http.post("/v1/feedback", json=body).json()
    assert fb["status"] == "accepted" and fb["score"] > 0 and fb["threshold"] == 0.0
    assert fb["redactions"] == {"EMAIL": 1, "PHONE": 1, "CARD": 1, "IBAN": 1}
    lesson = server.service.sessions().get(ServeLesson, fb["id"])
    assert "4111" not in lesson.feedback and "[CARD]" in lesson.feedback
    other = server.http.post("/v1/feedback", json={**body, "user": "mallory"})
    assert other.status_code in (403, 404)  # someone else's completion is not theirs to rate
    codes = [server.http.post("/v1/feedback", json=body).status_code for _ in range(3)]
    assert codes == [200, 200, 429]  # lessons_per_hour = 3


def test_admin_needs_the_token_and_lists_tenants(server):
    assert server.http.get("/admin/tenants").status_code == 401
    bad = server.http.get("/admin/tenants", headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    data = server.http.get("/admin/tenants", headers=ADMIN).json()["data"]
    assert "user:carol" in {t["scope"] for t in data}
    r = server.http.post("/admin/tenants/user:carol/pause", headers=ADMIN).json()
    assert r["paused"] is True


def test_delete_tenant_with_proof(server, tiny_dir, tmp_path):
    reg = server.service.registry
    client = server.client()
    res = ask(client, "remember me", user="erin").parse()
    server.http.post("/v1/consent", json={"user": "erin", "learning": True})
    res = ask(client, "remember me", user="erin").parse()
    server.http.post("/v1/feedback", json={"completion_id": res.id, "text": "no", "user": "erin"})
    v = propose(reg, tiny_dir, tmp_path / "e", "user:erin", seed=5)
    reg.promote(v, force=True)
    assert ask(client, "x", user="erin").headers["x-selfdistill-adapter"] == v
    weights = reg.weights_path(v)
    r = server.http.delete("/admin/tenants/user:erin", headers=ADMIN)
    proof = r.json()
    assert r.status_code == 200 and proof["deleted"] is True
    assert proof["removed"]["lessons"] == 1 and proof["removed"]["completions"] == 2
    assert proof["removed"]["versions"] == 1 and proof["removed"]["activations"] == 1
    assert proof["removed"]["files"] >= 2 and set(proof["remaining"].values()) == {0}
    assert not weights.exists() and count(server, ServeLesson, "user:erin") == 0
    assert ask(client, "x", user="erin").headers["x-selfdistill-adapter"] == "base"


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "default", "messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages[0].role"),
    ({"model": "default", "messages": []}, 400, "messages"),
    ({"model": "default", "messages": [{"role": "user", "content": "x" * 20_001}]}, 400,
     "messages[0].content"),
    ({"model": "default", "messages": [{"role": "user", "content": "x"}], "temperature": 9},
     400, "temperature"),
    ({"model": "default", "messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6},
     400, "max_tokens"),
    ({"model": "default", "messages": [{"role": "assistant", "content": "x"}]}, 400, "messages"),
    ({"model": "default", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     400, "messages[0].content"),
])
def test_malformed_requests_get_openai_errors(server, body, status, param):
    r = server.http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and "Traceback" not in r.text


def test_malformed_bodies(server):
    h = {"Content-Type": "application/json"}
    r = server.http.post("/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = server.http.post("/v1/chat/completions", content=b"[1, 2]", headers=h)
    assert r.status_code == 400
    r = server.http.post("/v1/chat/completions", content=b"x" * 1_000_001, headers=h)
    assert r.status_code == 413
    r = server.http.post("/v1/completions", json={"model": "default", "prompt": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = server.http.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no such endpoint"
    client = server.client()
    with pytest.raises(NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(BadRequestError):
        client.chat.completions.create(model="default", messages=[{"role": "tool",
                                                                   "content": "x"}])


def test_every_candidate_is_scored_and_only_those_above_the_threshold_kept(server):
    client = server.client()
    server.http.post("/v1/consent", json={"user": "frank", "learning": True})
    server.http.post("/admin/tenants/user:frank/pause", headers=ADMIN)  # score, do not learn
    first = ask(client, "Draft an email to Ann", user="frank").parse()
    convo = [{"role": "user", "content": "Draft an email to Ann"},
             {"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "What is 27*4?"}]
    client.chat.completions.create(model="default", messages=convo, max_tokens=2, user="frank")
    [implicit] = state.lessons(server.service.sessions, scope="user:frank")
    assert implicit["status"] == "pending" and implicit["completion_id"] == first.id
    server.service.cfg.learner.threshold = 1e9  # nothing is a lesson now
    try:
        assert server.http.post("/admin/learner/tick", headers=ADMIN).json()["rounds"] == []
        fb = server.http.post("/v1/feedback", json={"completion_id": first.id, "user": "frank",
                                                    "text": "Shorter, please."}).json()
    finally:
        server.service.cfg.learner.threshold = 0.0
    assert fb["status"] == "rejected" and fb["score"] > 0
    rows = {r.id: r for r in server.service.sessions().query(ServeLesson).filter_by(
        scope="user:frank")}
    assert rows[implicit["id"]].status == "rejected" and rows[implicit["id"]].score > 0
    assert rows[implicit["id"]].threshold == 1e9 and rows[fb["id"]].status == "rejected"


def test_hot_swap_keeps_in_flight_requests_on_their_adapter(server, tiny_dir, tmp_path):
    import json

    reg = server.service.registry
    v1 = propose(reg, tiny_dir, tmp_path / "g1", "user:gina", seed=11)
    v2 = propose(reg, tiny_dir, tmp_path / "g2", "user:gina", seed=12)
    reg.promote(v1, force=True)
    body = {"model": "default", "user": "gina", "stream": True, "max_tokens": 24,
            "temperature": 0, "messages": [{"role": "user", "content": "Tell me a story"}]}
    text, versions = "", set()
    with server.http.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        for line in lines:  # the stream has started on v1 ...
            if line.startswith("data: {"):
                versions.add(json.loads(line[6:])["selfdistill"]["version"])
                break
        reg.promote(v2, force=True)  # ... then v2 is promoted and loaded (hot swap)
        server.service.ensure_version(v2)
        for line in lines:
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                versions.add(chunk["selfdistill"]["version"])
                text += chunk["choices"][0]["delta"].get("content") or ""
    assert versions == {v1}
    after = server.client().chat.completions.create(**{**body, "stream": False})
    assert after.selfdistill["version"] == v2
    reg.rollback("user:gina")  # back to v1: the same greedy text as the in-flight request
    again = server.client().chat.completions.create(**{**body, "stream": False})
    assert again.selfdistill["version"] == v1 and again.choices[0].message.content == text
    # Decoding steps of requests on different adapters interleave under the engine's lock; each
    # step selects its request's adapter, so a request never decodes with another's weights.
    from selfdistill.serve.generation import Generation

    eng = server.service.engine
    ids = server.service.prompt([{"role": "user", "content": "Tell me a story"}])
    with eng.pin(v1):
        alone = Generation(eng, ids, v1, 12, temperature=0).run()
        mixed = Generation(eng, ids, v1, 12, temperature=0)
        steps = iter(mixed)
        head = [next(steps) for _ in range(4)]
        with eng.pin(v2):
            other = Generation(eng, ids, v2, 12, temperature=0).run()
        rest = list(steps)
    assert len(head) == 4 and rest
    assert [t.id for t in mixed.tokens] == [t.id for t in alone.tokens]
    assert [t.logprob for t in mixed.tokens] == [t.logprob for t in alone.tokens]
    assert [t.id for t in other.tokens] != [t.id for t in alone.tokens]


def test_cli_tenants_delete_and_help_config(tmp_path, capsys):
    import json

    from selfdistill.cli import main

    assert main(["serve", "--help-config"]) == 0
    assert "learner.threshold" in capsys.readouterr().out
    assert main(["tenants", "delete"]) == 2
    assert "name the tenant" in capsys.readouterr().err
    assert main(["serve", "nosuch.yaml"]) == 2
    assert main(["tenants", "delete", "user:zed", "--set", f"home={tmp_path}"]) == 0
    proof = json.loads(capsys.readouterr().out)
    assert proof["deleted"] is True and set(proof["removed"].values()) == {0}
    assert main(["tenants", "list", "--set", f"home={tmp_path}"]) == 0


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/feedback", {"text": "x", "user": "carol"}, 400, "completion_id"),
    ("/v1/feedback", {"completion_id": "c", "text": "", "user": "carol"}, 400, "text"),
    ("/v1/feedback", {"completion_id": "c", "text": "x", "rating": 5, "user": "carol"}, 400,
     "rating"),
    ("/v1/feedback", {"completion_id": "c", "text": "x", "user": "carol"}, 404, "completion_id"),
    ("/v1/feedback", {"completion_id": "c", "text": "x"}, 400, "user"),
    ("/v1/completions", {"model": "default"}, 400, "prompt"),
    ("/v1/completions", {"model": "default", "prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions", {"model": "default", "prompt": "x", "n": 2}, 400, "n"),
    ("/v1/consent", {"user": "carol"}, 400, "learning"),
])
def test_malformed_feedback_and_completions(server, path, body, status, param):
    r = server.http.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
