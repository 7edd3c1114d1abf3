"""A session with `selfdistill serve` through the official openai client: a user's correction
changes that user's later answers and nobody else's, through the gate, and an operator rolls it
back.

    python examples/serve_session.py                 # the embedded default model (minutes on CPU)
    python examples/serve_session.py --model DIR     # any Hugging Face model directory

It starts the server as a separate process (state in a temporary directory unless --home), with
learning consent for alice only, and calls the learner explicitly (`POST /admin/learner/tick`) so
the transcript is reproducible; a running server does the same in the background.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from openai import OpenAI

TOKEN = "example-admin-token"
QUESTION = "What is the capital of Veloria?"
CORRECTION = "That is wrong. The capital of Veloria is Marquenta."


def start(model: str, home: Path, port: int, steps: int, anchors: int,
          precision: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "selfdistill", "--quiet", "serve", f"model={model}",
           f"home={home}", f"port={port}", f"admin_token={TOKEN}", "learner.enabled=false",
           "governance.consent={'user:alice': true}", "learner.every_lessons=4",
           f"learner.steps={steps}", "learner.batch_size=4", "learner.learning_rate=3e-3",
           "learner.lora_rank=16", "learner.max_new_tokens=24",
           f"learner.anchor_batch_size={anchors}", "learner.anchor_weight=2",
           f"learner.precision={precision}"]
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr)
    for _ in range(1200):
        if proc.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    raise SystemExit("the server did not come up")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--home", default=None, help="server state directory (default: a temp dir)")
    p.add_argument("--steps", type=int, default=10, help="learner steps per round")
    p.add_argument("--anchors", type=int, default=8, help="anchor prompts per learner step")
    p.add_argument("--precision", default="auto", choices=["float32", "bfloat16", "auto"])
    p.add_argument("--out", default=None, help="write the transcript as JSON here")
    args = p.parse_args()
    home = Path(args.home or tempfile.mkdtemp(prefix="serve-session-"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start(args.model, home, port, args.steps, args.anchors, args.precision)
    log: list[dict] = []
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=3600)
        admin = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600,
                             headers={"Authorization": f"Bearer {TOKEN}"})

        def ask(user: str, label: str, **kw) -> str:
            res = client.chat.completions.create(
                model="default", user=user, max_tokens=24,
                messages=[{"role": "user", "content": QUESTION}], **{"temperature": 0, **kw})
            text, version = res.choices[0].message.content, res.selfdistill["version"]
            print(f"[{label}] {user}: {text!r}   (adapter: {version or 'base'})")
            log.append({"step": label, "user": user, "answer": text, "adapter": version})
            return res.id

        ask("alice", "before")
        ask("bob", "before")
        for i in range(4):  # alice corrects four sampled answers
            cid = ask("alice", f"sample {i}", temperature=0.8, seed=i)
            fb = admin.post("/v1/feedback", json={"completion_id": cid, "user": "alice",
                                                   "text": CORRECTION}).json()
            print(f"  feedback → {fb['status']} (score {fb['score']:.3f} nats/token)")
            log.append({"step": "feedback", **fb})
        t0 = time.time()
        [rnd] = admin.post("/admin/learner/tick").json()["rounds"]
        verdict = rnd["verdict"] or {}
        print(f"learning round: {time.time() - t0:.0f} s, version {rnd['version_id'][:12]}, "
              f"gate: {verdict.get('summary') or rnd['error']}")
        for c in verdict.get("checks", []):
            print(f"  {c['name']}: {c['before']} → {c['after']} ({c['rule']}) "
                  f"{'ok' if c['passed'] else 'FAILED'}")
        log.append({"step": "round", **rnd})
        if not rnd["promoted"]:
            print("the gate rejected the update: alice still gets the base model. For the rest "
                  "of the demonstration an operator forces it (recorded as forced):")
            admin.post("/admin/tenants/user:alice/promote", json={
                "version": rnd["version_id"], "force": True, "reason": "demo after REJECT"})
        ask("alice", "after")
        ask("bob", "after")
        rb = admin.post("/admin/tenants/user:alice/rollback",
                        json={"reason": "demo rollback"}).json()
        print(f"rollback: user:alice → {rb['version'] or 'base'}")
        ask("alice", "rolled back")
    finally:
        proc.terminate()
        proc.wait(60)
    if args.out:
        Path(args.out).write_text(json.dumps(log, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
