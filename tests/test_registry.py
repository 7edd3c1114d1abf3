"""The adapter registry: content addressing, gates that really evaluate, promotion history,
bit-identical rollback, tenant isolation, concurrency, crash safety, quotas, gc, CLI.

Tiny models only (tests/registry_world.py builds them); the backend tests run on SQLite and on a
fresh PostgreSQL database (skipped only when CI is unset and no server answers, as test_store).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
import threading
import time

import pytest

from selfdistill.cli import main
from selfdistill.errors import UserError
from selfdistill.registry import GateSpec, PromotionConflict, Registry, TaskSuite, adapter_id
from selfdistill.store import TraceStore
from tests import registry_world, test_store
from tests.registry_world import REPO, World, behaviour, same

# Fixtures defined elsewhere, used here by name: the constructed world; SQLite / fresh PostgreSQL.
world = registry_world.world
db_url, pg_admin = test_store.db_url, test_store.pg_admin


pytestmark = pytest.mark.usefixtures("one_thread")


def no_regress(w: World, **extra) -> GateSpec:
    """A gate the base's exact behaviour passes: task may not drop, own probes only."""
    return GateSpec(
        tasks={"train": TaskSuite(path=str(w.task), must="not_regress")},
        probes=[str(w.probes)],
        max_new_tokens=8,
        **extra,
    )


@pytest.fixture
def reg(tmp_path):
    with Registry(tmp_path / "reg") as r:
        yield r


def resolved(reg: Registry, **who):
    lm, res = reg.load_resolved(**who)
    return behaviour(lm.model, lm.tokenizer), res


# -- versions -----------------------------------------------------------------------------------


def test_same_weights_same_version_and_lineage(world, reg, tmp_path):
    a = reg.propose(world.run(tmp_path / "a", seed=1, scale=0.1, attempts=3))
    assert a["created"] and a["scope"] == "global" and len(a["id"]) == 64
    assert a["parent_id"] is None and a["run_name"] == "a" and len(a["data_ids"]) == 3
    with TraceStore(path=tmp_path / "a") as store:  # the attempts that trained it, in order
        assert a["data_ids"] == store.attempts_consumed(store.runs()[0]["id"])
    assert a["base_sha256"] and a["config"]["scope"] == "global" and a["train_gate"]
    # the same weights from another run directory (another base path in the PEFT config)
    copy = world.run(tmp_path / "copy", seed=1, scale=0.1)
    cfg = json.loads((copy / "adapter" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = "/elsewhere"
    (copy / "adapter" / "adapter_config.json").write_text(json.dumps(cfg))
    again = reg.propose(copy)
    assert again["id"] == a["id"] and not again["created"]
    assert adapter_id(copy / "adapter") == a["id"] != adapter_id(world.harmful_adapter)
    with pytest.raises(UserError, match="belongs to one scope"):
        reg.propose(copy, scope="user:alice")
    reg.promote(a["id"][:8], force=True)
    b = reg.propose(world.run(tmp_path / "b", seed=2, scale=0.1))
    assert b["parent_id"] == a["id"]  # default parent: the scope's active version
    chain = reg.lineage(b["short"])
    assert [v["id"] for v in chain] == [b["id"], a["id"]] and chain[1]["data_ids"] == a["data_ids"]
    d = reg.diff(a["id"], b["id"])
    assert d["train_after"]["train"] == {"a": 0.125, "b": 0.25}
    with pytest.raises(UserError, match="not a version id"):
        reg.show("xyz")
    with pytest.raises(UserError, match="no adapter version"):
        reg.show("0000000")


def test_real_training_run_is_proposed_with_its_evidence(world, reg, tmp_path):
    from selfdistill.train import load_config, run_training

    cfg = load_config(
        None,
        [
            f"model={world.base_dir}",
            f"output_dir={tmp_path / 'run'}",
            f"train_data={REPO}/examples/knowledge/train.jsonl",
            "steps=1",
            "batch_size=2",
            "max_new_tokens=4",
            "eval.max_new_tokens=4",
            "eval.oracle=false",
            "probe_data=null",
            "threads=1",
            "scope=workspace:acme",
            "checkpoint_every=0",
        ],
    )
    run_training(cfg, progress=False)
    v = reg.propose(tmp_path / "run")
    with TraceStore(path=tmp_path / "run") as store:
        [run] = store.runs()
        assert v["data_ids"] == store.attempts_consumed(run["id"]) and len(v["data_ids"]) == 2
    assert v["scope"] == "workspace:acme" and v["run_id"] == run["id"]
    assert v["metrics"]["steps"] == 1 and "after" in v["metrics"]


# -- gates --------------------------------------------------------------------------------------


def test_gate_rejects_harmful_adapter_and_leaves_active_untouched(world, reg, tmp_path):
    good = reg.propose(world.run(tmp_path / "good", seed=3))  # B = 0: the base's behaviour
    res = reg.promote(good["id"], gate=no_regress(world))
    assert res["promoted"] and res["gate"]["passed"] and res["previous"] is None
    bad = reg.propose(world.run(tmp_path / "bad", harmful=True))
    before = reg.history("global")
    res = reg.promote(bad["id"])  # the default gate, from the run's own config
    assert not res["promoted"] and res["active"] == good["id"]
    checks = {c["name"]: c for c in res["gate"]["verdict"]["checks"]}
    assert checks["task:train"]["passed"] and checks["task:train"]["after"] == 1.0  # it "learned"
    probes = checks["forgetting_probes"]
    assert not probes["passed"] and probes["before"] == 22 and probes["after"] == 0
    assert res["gate"]["baseline_version_id"] == good["id"]  # evaluated against the active one
    assert reg.resolve().version == good["id"] and reg.history("global") == before
    assert [g["passed"] for g in reg.show(bad["id"])["gate_runs"]] == [False]
    # forcing it is possible, and recorded as forced, with who and why
    res = reg.promote(bad["id"], force=True, actor="ops", reason="incident 12")
    act = reg.history("global")[-1]
    assert res["promoted"] and res["gate"] is None
    assert (act["action"], act["actor"], act["reason"]) == ("force", "ops", "incident 12")
    assert (act["from_version_id"], act["to_version_id"]) == (good["id"], bad["id"])


def test_custom_check_by_dotted_path(world, reg, tmp_path, monkeypatch):
    (tmp_path / "mychecks.py").write_text(
        "from tests.registry_world import answers\n"
        "def no_banana(model, tok):\n"
        "    said = answers(model, tok, ['Who wrote Hamlet?'])[0]\n"
        "    return {'passed': 'banana' not in said, 'value': float('banana' in said)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    bad = reg.propose(world.run(tmp_path / "bad", harmful=True))
    spec = no_regress(world, probe_tolerance=100, checks=["mychecks:no_banana"])
    res = reg.promote(bad["id"], gate=spec)
    [check] = [c for c in res["gate"]["verdict"]["checks"] if c["name"].startswith("check:")]
    assert not res["promoted"] and (check["before"], check["after"]) == (0.0, 1.0)
    with pytest.raises(UserError, match="cannot import"):
        reg.promote(bad["id"], gate=no_regress(world, checks=["mychecks:nope"]))


# -- promotion, rollback, resolution, isolation -------------------------------------------------


def test_rollback_is_bit_identical_and_history_complete(world, reg, tmp_path):
    base_out, res = resolved(reg)
    assert res.version is None
    a = reg.propose(world.run(tmp_path / "a", seed=1, scale=0.5))["id"]
    b = reg.propose(world.run(tmp_path / "b", seed=2, scale=0.5))["id"]
    reg.promote(a, force=True)
    out_a, _ = resolved(reg)
    reg.promote(b, force=True)
    out_b, res = resolved(reg)
    assert res.version == b and not same(out_a, out_b) and not same(base_out, out_a)
    res = reg.rollback("global", reason="regression")
    assert (res["version"], res["previous"]) == (a, b)
    after, res = resolved(reg)
    assert res.version == a and same(after, out_a)  # same greedy ids, exactly equal logits
    reg.rollback("global")  # the promotion of a is undone too: the base model again
    after, res = resolved(reg)
    assert res.version is None and same(after, base_out)
    with pytest.raises(UserError, match="nothing to roll back"):
        reg.rollback("global")
    reg.rollback("global", to=b[:10])  # any version once active, by prefix
    assert reg.resolve().version == b
    hist = reg.history("global")
    assert [(h["seq"], h["action"]) for h in hist] == [
        (1, "force"),
        (2, "force"),
        (3, "rollback"),
        (4, "rollback"),
        (5, "rollback"),
    ]
    assert [h["to_version_id"] for h in hist] == [a, b, a, None, b]
    assert all(h["from_version_id"] == p["to_version_id"] for p, h in itertools.pairwise(hist))
    assert (tmp_path / "reg" / "adapters" / a).is_dir()  # rolling back deletes nothing


def test_resolution_order_and_isolation(world, reg, tmp_path):
    g = reg.propose(world.run(tmp_path / "g", seed=1, scale=0.5))["id"]
    w = reg.propose(world.run(tmp_path / "w", scope="workspace:acme", seed=2, scale=0.5))["id"]
    reg.promote(g, force=True)
    reg.promote(w, force=True)
    bob, res_bob = resolved(reg, user="bob", workspace="acme")
    glob, res_glob = resolved(reg, user="bob")
    assert (res_bob.scope, res_bob.version) == ("workspace:acme", w)
    assert (res_glob.scope, res_glob.version) == ("global", g)
    assert res_bob.order == ["user:bob", "workspace:acme", "global"]
    # alice trains, proposes and promotes: only alice's resolution changes
    al = reg.propose(world.run(tmp_path / "al", scope="user:alice", seed=3, scale=0.5))["id"]
    with pytest.raises(UserError, match="only activates its own"):
        reg.promote(al, scope="user:bob", force=True)
    reg.promote(al, force=True)
    alice, res = resolved(reg, user="alice", workspace="acme")
    assert (res.scope, res.version) == ("user:alice", al) and not same(alice, bob)
    bob2, res2 = resolved(reg, user="bob", workspace="acme")
    glob2, res3 = resolved(reg, user="bob")
    assert same(bob, bob2) and same(glob, glob2) and res2 == res_bob and res3 == res_glob
    reg.rollback("global", to="base")
    assert reg.resolve(user="carol").version is None  # nothing active anywhere: the base


def test_one_tenant_never_waits_for_anothers_gate(world, reg, tmp_path):
    entered, release = threading.Event(), threading.Event()

    def blocking(model, tok):
        entered.set()
        assert release.wait(60)
        return {"passed": True}

    al1 = reg.propose(world.run(tmp_path / "al1", scope="user:alice", seed=1))["id"]
    al2 = reg.propose(world.run(tmp_path / "al2", scope="user:alice", seed=2))["id"]
    bob = reg.propose(world.run(tmp_path / "bob", scope="user:bob", seed=3))["id"]
    errors: list[BaseException] = []

    def gated() -> None:
        try:
            reg.promote(al1, gate=no_regress(world, checks=[blocking]))
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=gated)
    t.start()
    assert entered.wait(60)
    t0 = time.perf_counter()
    reg.promote(bob, force=True)  # bob's scope goes ahead while alice's gate runs
    reg.promote(al2, force=True)  # and alice's scope changes under her gate
    assert time.perf_counter() - t0 < 5
    release.set()
    t.join(60)
    assert len(errors) == 1 and isinstance(errors[0], PromotionConflict)  # stale verdict refused
    assert reg.resolve(user="alice").version == al2 and reg.resolve(user="bob").version == bob


def test_crash_inside_the_promotion_transaction_changes_nothing(world, reg, tmp_path, monkeypatch):
    a = reg.propose(world.run(tmp_path / "a", seed=1))["id"]
    b = reg.propose(world.run(tmp_path / "b", seed=2))["id"]
    reg.promote(a, force=True)
    original = Registry._activate

    def crash(self, *args, **kwargs):
        original(self, *args, **kwargs)  # pointer moved and activation written (flushed) ...
        raise RuntimeError("power cut")  # ... but never committed

    monkeypatch.setattr(Registry, "_activate", crash)
    with pytest.raises(RuntimeError):
        reg.promote(b, force=True)
    with pytest.raises(RuntimeError):
        reg.rollback("global")
    assert reg.resolve().version == a and len(reg.history("global")) == 1


def test_crash_while_writing_weights_leaves_no_version(world, tmp_path):
    run = world.run(tmp_path / "a", seed=1, scale=0.1)
    script = (
        "import os, sys\n"
        "from selfdistill.registry import weights\n"
        "def half(src, dst):\n"
        "    if src.name.endswith('.safetensors'):\n"
        "        dst.write_bytes(src.read_bytes()[:1000]); os._exit(137)  # killed mid-write\n"
        "    dst.write_bytes(src.read_bytes())\n"
        "weights._copy_durably = half\n"
        "from selfdistill.registry import Registry\n"
        "Registry(sys.argv[1]).propose(sys.argv[2])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "reg"), str(run)],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
    )
    assert proc.returncode == 137, proc.stderr.decode()[-2000:]
    with Registry(tmp_path / "reg") as reg:
        assert reg.list() == [] and reg.weights.stored_ids() == []
        leftovers = list((tmp_path / "reg" / "adapters").glob(".incoming-*"))
        assert len(leftovers) == 1  # the half-written copy, under a name never read as a version
        assert reg.gc(grace_s=0)["stale"] == [leftovers[0].name]
        v = reg.propose(run)
        assert v["created"] and v["id"] == adapter_id(run / "adapter")


# -- storage ------------------------------------------------------------------------------------


def test_quota_per_scope_and_gc_removes_only_unreferenced(world, reg, tmp_path):
    a = reg.propose(world.run(tmp_path / "a", scope="user:alice", seed=1, scale=0.1))
    reg.set_quota("user:alice", int(a["size_bytes"] * 1.5))
    with pytest.raises(UserError, match="quota exceeded"):
        reg.propose(world.run(tmp_path / "b", scope="user:alice", seed=2, scale=0.1))
    assert len(reg.weights.stored_ids()) == 1  # refused before anything was written
    reg.propose(world.run(tmp_path / "g", seed=3, scale=0.1))  # other scopes are unaffected
    reg.promote(a["id"], force=True)
    # versions: a active; c once active (rolled back); d never active; plus an orphan on disk
    reg.set_quota("user:alice", None)
    c = reg.propose(world.run(tmp_path / "c", scope="user:alice", seed=4, scale=0.1))["id"]
    d = reg.propose(world.run(tmp_path / "d", scope="user:alice", seed=5, scale=0.1))["id"]
    reg.promote(c, force=True)
    reg.rollback("user:alice")
    orphan = reg.weights.root / ("f" * 64)
    orphan.mkdir()
    assert reg.gc() == {
        "dry_run": False,
        "versions": [],
        "orphans": [],
        "stale": [],
        "freed_bytes": 0,
    }  # everything is younger than the grace period
    dry = reg.gc(grace_s=0, dry_run=True)
    assert set(dry["versions"]) >= {d} and (reg.weights.root / d).is_dir()
    res = reg.gc(grace_s=0)
    assert d in res["versions"] and a["id"] not in res["versions"] and c not in res["versions"]
    assert res["orphans"] == ["f" * 64] and not orphan.exists()
    assert not (reg.weights.root / d).exists() and reg.show(d)["weights_deleted_at"]
    reg.rollback("user:alice", to=c)  # what was ever active stays restorable
    with pytest.raises(UserError, match="removed by gc"):
        reg.promote(d, force=True)
    again = reg.propose(tmp_path / "d")  # proposing the same weights again restores them
    assert again["id"] == d and not again["created"] and again["weights_deleted_at"] is None
    assert reg.promote(d, force=True)["promoted"]
    reg.rollback("user:alice")
    # a, c and the restored d are stored: room for exactly one more
    reg.set_quota("user:alice", 4 * a["size_bytes"] + 10)
    reg.propose(world.run(tmp_path / "e", scope="user:alice", seed=6, scale=0.1))


def test_existing_trace_store_is_upgraded(tmp_path):
    from sqlalchemy import create_engine

    from selfdistill.store.migrations import upgrade

    db = tmp_path / "old.db"
    engine = create_engine(f"sqlite:///{db}")
    upgrade(engine, "0001")  # a store written before the registry existed
    engine.dispose()
    with TraceStore(path=db) as store:
        run = store.create_run("old")
    with Registry(db) as reg:
        assert reg.list() == [] and reg.store.get_run(run)["name"] == "old"


# -- both database backends ---------------------------------------------------------------------


class TestBackends:
    def test_lifecycle(self, world, db_url, tmp_path):
        with Registry(db_url, weights_dir=tmp_path / "w") as reg:
            a = reg.propose(world.run(tmp_path / "a", seed=1))["id"]
            b = reg.propose(world.run(tmp_path / "b", seed=2))["id"]
            assert reg.promote(a, gate=no_regress(world))["promoted"]
            assert reg.promote(b, gate=no_regress(world))["promoted"]
            assert reg.rollback("global")["version"] == a
            assert [v["id"] for v in reg.list()] == [a, b]
            assert reg.list()[0]["active_in"] == ["global"]
            assert reg.show(b)["gate_runs"][0]["baseline_version_id"] == a

    def test_concurrent_promote_and_rollback_keep_history_consistent(self, world, db_url, tmp_path):
        with Registry(db_url, weights_dir=tmp_path / "w") as reg:
            ids = [reg.propose(world.run(tmp_path / f"v{i}", seed=i))["id"] for i in range(3)]
            done: list[int] = []

            def worker(k: int) -> None:
                rng = random.Random(k)
                for _ in range(6):
                    try:
                        if rng.random() < 0.6:
                            reg.promote(rng.choice(ids), force=True, actor=f"t{k}")
                        else:
                            reg.rollback("global", actor=f"t{k}")
                        done.append(k)
                    except UserError:  # already active / nothing to roll back: refused whole
                        pass

            threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            hist = reg.history("global")
            assert len(hist) == len(done) > 0 and [h["seq"] for h in hist] == list(
                range(1, len(hist) + 1)
            )
            assert hist[0]["from_version_id"] is None
            chained = itertools.pairwise(hist)
            assert all(h["from_version_id"] == p["to_version_id"] for p, h in chained)
            assert reg.resolve().version == hist[-1]["to_version_id"]
            [scope] = [s for s in reg.scopes() if s["name"] == "global"]
            assert scope["active_version_id"] == hist[-1]["to_version_id"]

    def test_row_lock_is_per_scope(self, world, db_url, tmp_path):
        if db_url.startswith("sqlite"):
            pytest.skip(
                "SQLite has one writer per file (held for milliseconds); row locks are PostgreSQL's"
            )
        with Registry(db_url, weights_dir=tmp_path / "w") as reg:
            bob = reg.propose(world.run(tmp_path / "b", scope="user:bob", seed=1))["id"]
            holding, release = threading.Event(), threading.Event()

            def hold_alice() -> None:
                with reg._locked("user:alice"):
                    holding.set()
                    release.wait(30)

            t = threading.Thread(target=hold_alice)
            t.start()
            assert holding.wait(30)
            t0 = time.perf_counter()
            reg.promote(bob, force=True)
            assert time.perf_counter() - t0 < 5
            release.set()
            t.join(30)


# -- CLI ----------------------------------------------------------------------------------------


def cli(capsys, *args: str) -> tuple[int, object]:
    code = main(["--quiet", "adapters", *args])
    out, err = capsys.readouterr()
    if "--json" in args and code in (0, 1):
        return code, json.loads(out)
    return code, out + err


def test_cli(world, tmp_path, capsys):
    r = ["--registry", str(tmp_path / "reg")]
    good, bad = world.run(tmp_path / "good", seed=1), world.run(tmp_path / "bad", harmful=True)
    code, g = cli(capsys, "propose", str(good), *r, "--json")
    assert code == 0 and g["created"]
    code, res = cli(
        capsys,
        "promote",
        g["short"],
        *r,
        "--json",
        "--task-data",
        f"train={world.task}",
        "--task-tolerance",
        "0",
        "--no-builtin-probes",
        "--probe-data",
        str(world.probes),
    )
    assert code == 0 and res["promoted"]
    code, h = cli(capsys, "propose", str(bad), *r, "--json")  # parent: the active g
    code, rows = cli(capsys, "list", *r, "--json")
    assert [(v["id"], v["active_in"]) for v in rows] == [(g["id"], ["global"]), (h["id"], [])]
    code, res = cli(capsys, "promote", h["id"][:6], *r, "--json")  # default gate: rejected
    assert code == 1 and not res["promoted"] and res["active"] == g["id"]
    code, res = cli(capsys, "promote", h["id"][:6], *r, "--force", "--reason", "test", "--json")
    assert code == 0 and res["forced"]
    code, res = cli(capsys, "resolve", "--user", "alice", *r, "--json")
    assert (res["scope"], res["version"]) == ("global", h["id"])
    code, res = cli(capsys, "rollback", *r, "--json")
    assert code == 0 and res["version"] == g["id"]
    # Every generation says which adapter produced it and how it was resolved.
    gen = ["--quiet", "generate", "--prompt", "hi", "--max-new-tokens", "3", "--json", *r]
    assert main([*gen, "--user", "alice", "--workspace", "acme"]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["adapter"] == g["id"] and meta["resolution"] == {
        "scope": "global", "version": g["id"],
        "order": ["user:alice", "workspace:acme", "global"]}
    assert main(gen) == 0  # --registry alone: the global adapter
    meta = json.loads(capsys.readouterr().out)
    assert meta["resolution"] == {"scope": "global", "version": g["id"], "order": ["global"]}
    assert main([*gen, "--user", "alice", "--adapter", str(good / "adapter")]) == 2
    assert "give one" in capsys.readouterr().err
    code, d = cli(capsys, "diff", g["short"], h["short"], *r, "--json")
    assert d["gate"]["checks"]["forgetting_probes"]["b"]["passed"] is False
    code, chain = cli(capsys, "lineage", h["short"], *r, "--json")
    assert chain["chain"][1]["id"] == g["id"] and "flowchart TD" in chain["mermaid"]
    code, text = cli(capsys, "lineage", h["short"], *r, "--mermaid")
    assert f"v{g['short']} --> v{h['short']}" in text
    for args in (["history"], ["scopes"], ["show", g["short"]], ["gc", "--dry-run"], ["list"]):
        code, out = cli(capsys, *args, *r)
        assert code == 0 and out.strip()
    for args, words in [
        (["show", "zz"], "not a version id"),
        (["show", "0000"], "no adapter version"),
        (["propose", str(tmp_path / "nope")], "no such run directory"),
        (["rollback", "--scope", "user:x"], "nothing to roll back"),
        (["rollback", "--scope", "bad scope"], "scope"),
        (["quota", "--scope", "global", "--bytes", "lots"], "expected a size"),
        (["promote", g["short"], "--task-data", "oops"], "NAME=PATH"),
        (["promote", g["short"], "--gate", str(tmp_path / "missing.yaml")], "gate spec"),
    ]:
        code, out = cli(capsys, *args, *r)
        assert code == 2 and words in out and "Traceback" not in out, (args, out)
