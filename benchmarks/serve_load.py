"""Load test of `selfdistill serve`: N concurrent streaming chat clients on loopback for T seconds
while the learner trains and promotes in the background. Reports failed requests, lost feedback
(acknowledged by the server but not in its store), learning rounds and promotions, and latency
percentiles (time to first token, whole request).

    python benchmarks/serve_load.py                       # 50 clients, 60 s, tiny random model
    python benchmarks/serve_load.py --model default --clients 8 --seconds 120
    python benchmarks/serve_load.py --quick               # 4 clients, 5 s (the CI smoke run)

Clients are spread over `--users` tenants, all with consent; each sends streaming chat
requests back to back and, every `--feedback-every` requests, feedback on the completion it got
(which the learner turns into lessons, rounds and promotions). The server runs in its own
process (`selfdistill serve`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TOKEN = "bench-admin"


def percentiles(values: list[float], ps: tuple[float, ...] = (50, 90, 99)) -> dict[str, float]:
    """Nearest-rank percentiles (milliseconds in, milliseconds out); empty → {}."""
    if not values:
        return {}
    s = sorted(values)
    return {f"p{p:g}": s[max(0, math.ceil(p / 100 * len(s)) - 1)] for p in ps}


def tiny_model(root: Path) -> Path:
    """A tiny random Llama with the default model's tokenizer (fast to serve and to train)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from selfdistill.models import default_model_dir, load_tokenizer

    tok = load_tokenizer(str(default_model_dir(progress=False)))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    path = root / "tiny-model"
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def start_server(args: argparse.Namespace, home: Path, model: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "selfdistill", "--quiet", "serve", f"model={model}",
           f"home={home}", f"port={port}", f"admin_token={TOKEN}",
           "governance.consent_default=true", "governance.lessons_per_hour=100000",
           f"learner.every_lessons={args.every_lessons}", f"learner.steps={args.learn_steps}",
           "learner.threshold=0", "learner.poll_seconds=0.5", "learner.lora_rank=4",
           "learner.max_new_tokens=8", "learner.gate_max_new_tokens=8",
           "learner.anchor_batch_size=0",
           f"limits.max_tokens={max(args.max_tokens, 16)}"]
    log = (home / "server.log").open("w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


async def wait_up(root: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    async with httpx.AsyncClient() as c:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError("the server exited during start-up")
            try:
                if (await c.get(f"{root}/health")).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    raise RuntimeError("the server did not come up")


async def client(i: int, root: str, args: argparse.Namespace, stop: float, out: dict) -> None:
    """One user: streaming chat requests back to back, feedback every few requests."""
    user = f"bench{i % args.users}"
    async with httpx.AsyncClient(base_url=root, timeout=120) as c:
        n = 0
        while time.time() < stop:
            n += 1
            body = {"model": "default", "stream": True, "max_tokens": args.max_tokens,
                    "user": user, "messages": [{"role": "user",
                                                "content": f"Question {n} from {user}: name a "
                                                "colour."}]}
            t0 = time.perf_counter()
            first, cid, done = None, None, False
            try:
                async with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"HTTP {r.status_code}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        if line == "data: [DONE]":
                            done = True
                            break
                        chunk = json.loads(line[6:])
                        cid = chunk["id"]
                        if first is None and chunk["choices"] and chunk["choices"][0][
                                "delta"].get("content"):
                            first = time.perf_counter() - t0
                if not done:
                    raise RuntimeError("stream ended without [DONE]")
            except Exception as exc:  # any failure counts
                out["failures"].append(f"{user}#{n}: {type(exc).__name__}: {exc}"[:200])
                continue
            out["total_ms"].append((time.perf_counter() - t0) * 1000)
            if first is not None:
                out["ttft_ms"].append(first * 1000)
            if n % args.feedback_every == 0:
                fb = await c.post("/v1/feedback", json={
                    "completion_id": cid, "user": user, "text": "Wrong: say blue."})
                if fb.status_code == 200:
                    out["acked"].add(fb.json()["id"])
                else:
                    out["failures"].append(f"{user}#{n} feedback: HTTP {fb.status_code}")


async def run(args: argparse.Namespace) -> dict:
    home = Path(tempfile.mkdtemp(prefix="serve-load-"))
    model = args.model if args.model != "tiny" else str(tiny_model(home))
    with __import__("socket").socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = f"http://127.0.0.1:{port}"
    proc = start_server(args, home, model, port)
    try:
        await wait_up(root, proc)
        out: dict = {"failures": [], "total_ms": [], "ttft_ms": [], "acked": set()}
        t0 = time.time()
        stop = t0 + args.seconds
        await asyncio.gather(*(client(i, root, args, stop, out) for i in range(args.clients)))
        wall = time.time() - t0
        admin = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=root, timeout=600, headers=admin) as c:
            tenants = (await c.get("/admin/tenants")).json()["data"]
            stored = sum(sum(t["lessons"].values()) for t in tenants)
            rounds, promoted = 0, 0
            for t in tenants:
                info = (await c.get(f"/admin/tenants/{t['scope']}")).json()
                rounds += len(info["rounds"])
                promoted += sum(1 for r in info["rounds"] if r["promoted"])
    finally:
        proc.terminate()
        proc.wait(60)
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    return {
        "clients": args.clients, "users": args.users, "seconds": round(wall, 1),
        "model": args.model,
        "requests": len(out["total_ms"]) + len(out["failures"]),
        "failed": len(out["failures"]), "failures": out["failures"][:10],
        "feedback_acknowledged": len(out["acked"]), "feedback_stored": stored,
        "feedback_lost": max(0, len(out["acked"]) - stored),
        "learning_rounds": rounds, "promotions": promoted,
        "ttft_ms": percentiles(out["ttft_ms"]), "latency_ms": percentiles(out["total_ms"]),
        "requests_per_s": round(len(out["total_ms"]) / wall, 2),
        "load_average": os.getloadavg(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--clients", type=int, default=50)
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--model", default="tiny", help="'tiny' (random, default), 'default' (the "
                   "embedded SmolLM2-135M-Instruct) or a model directory")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--users", type=int, default=5, help="tenants the clients are spread over")
    p.add_argument("--feedback-every", type=int, default=2)
    p.add_argument("--every-lessons", type=int, default=4, help="learner: lessons per round")
    p.add_argument("--learn-steps", type=int, default=2, help="learner: steps per round")
    p.add_argument("--quick", action="store_true", help="4 clients for 5 s (smoke test)")
    p.add_argument("--out", default=None, help="write the JSON result here")
    p.add_argument("--keep", action="store_true", help="keep the server's state directory")
    args = p.parse_args(argv)
    if args.quick:
        args.clients, args.seconds, args.users, args.every_lessons = 4, 5.0, 2, 2
    res = asyncio.run(run(args))
    text = json.dumps(res, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0 if res["failed"] == 0 and res["feedback_lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
