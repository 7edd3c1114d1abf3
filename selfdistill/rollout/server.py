"""Rollouts from an OpenAI-compatible completions server with token log-probs and dynamic LoRA.

The same code talks to `vllm serve MODEL --enable-lora` (GPU; runtime loading needs
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) and to this project's `selfdistill serve` (CPU). Routes:

- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` / `POST /v1/unload_lora_adapter
  {"lora_name"}`: the learner saves its adapter (PEFT format) under `push_dir/NAME-stepNNNNNN`
  every `push_every` steps and asks the server to serve it under that name; the previous one is
  unloaded. `lora_path` must be readable by the server (same machine or shared filesystem).
- `POST /v1/completions` with `model` = the adapter name, `prompt` = token ids, `n` = 1, `seed`
  (one request per completion, seeded by its global sample index: the tokens do not depend on
  how the batch is split over ranks), `logprobs` = 0 and `return_tokens_as_token_ids`: the
  answer's `logprobs.tokens` ("token_id:N") and `logprobs.token_logprobs` (log π of each sampled
  token under the raw, temperature-1 distribution, nats) become `Completion.token_ids` /
  `Completion.logprobs`; the answer's `model` names the adapter, hence the version, it came from.
"""

from __future__ import annotations

import json
import math
import shutil
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from selfdistill.errors import UserError
from selfdistill.rollout.base import Sampler
from selfdistill.rollout.hf import Completion, eos_ids


class ServerSampler(Sampler):
    """Samples from a completions server; pushes the learner's adapter every `push_every` steps.

    `version` is the learner step of the adapter in use: steps `v … v+push_every−1` sample from
    version `v = step − step % push_every` (on resume, that version is reloaded from `push_dir`).
    """

    def __init__(self, url: str, tokenizer: Any, *, push_dir: str | Path, push_every: int = 1,
                 adapter_name: str = "selfdistill", timeout: float = 300.0,
                 concurrency: int = 16, stop_ids: list[int] | None = None) -> None:
        self.url = url.rstrip("/")
        self.tokenizer = tokenizer
        self.push_dir = Path(push_dir)
        self.push_every = push_every
        self.prefix = adapter_name
        self.timeout = timeout
        self.concurrency = concurrency
        self.stop_ids = stop_ids or eos_ids(None, tokenizer)
        self.loaded: str | None = None  # the adapter name the server serves for us
        self.version = -1
        self.pushes = 0  # adapters uploaded by this process

    def adapter_name(self, version: int) -> str:
        return f"{self.prefix}-step{version:06d}"

    def sync(self, model: Any, step: int, dist: Any = None) -> None:
        """Serve version `step − step % push_every`: the main rank saves and loads it, and
        every rank learns the name chosen (via `dist.gather`, which also waits for the load)."""
        version = step - step % self.push_every
        if version <= self.version:  # already serving it (or, after a lost push, a newer one)
            return
        name = self.adapter_name(version)
        if dist is None or dist.is_main:
            path = self.push_dir / name
            if version == step or not (path / "adapter_config.json").is_file():
                version, name = step, self.adapter_name(step)  # resumed past a lost push
                path = self.push_dir / name
                _save_adapter(model, path)
            if name in self.served():  # a stale copy (an earlier run, or before a resume)
                self.call("/v1/unload_lora_adapter", {"lora_name": name})
            self.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            if self.loaded is not None and self.loaded != name:
                self.call("/v1/unload_lora_adapter", {"lora_name": self.loaded})
            self.pushes += 1
        if dist is not None and dist.world > 1:
            version, name = dist.gather((version, name))[0]
        self.loaded, self.version = name, version

    def sample(self, prompts: list[list[int]], *, n: int, max_new_tokens: int,
               temperature: float, top_p: float, seeds: list[int]) -> list[list[Completion]]:
        if self.loaded is None:
            raise RuntimeError("ServerSampler.sample before sync(): no adapter is being served")
        if len(seeds) != len(prompts) * n:
            raise ValueError(f"need one seed per completion ({len(prompts) * n}), "
                             f"got {len(seeds)}")
        flat = [(p, seeds[i * n + j]) for i, p in enumerate(prompts) for j in range(n)]

        def one(item: tuple[list[int], int]) -> Completion:
            prompt, seed = item
            body = {"model": self.loaded, "prompt": prompt, "n": 1, "seed": seed,
                    "max_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            return self._completion(prompt, self.call("/v1/completions", body))

        with ThreadPoolExecutor(max_workers=min(self.concurrency, max(len(flat), 1))) as pool:
            out = list(pool.map(one, flat))
        return [out[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _completion(self, prompt: list[int], resp: dict[str, Any]) -> Completion:
        """One `/v1/completions` answer → `Completion` (EOS appended, with log-prob NaN =
        unknown, when the server stopped on it without returning it)."""
        try:
            choice = resp["choices"][0]
            lp = choice.get("logprobs") or {}
            ids = choice.get("token_ids") or [_token_id(t) for t in lp.get("tokens", [])]
            lps = [math.nan if v is None else float(v) for v in lp.get("token_logprobs") or []]
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise UserError(f"{self.url}/v1/completions: unexpected answer ({exc!r}); the "
                            "server must return choices[0].logprobs with tokens as token ids "
                            "(return_tokens_as_token_ids) and token_logprobs") from None
        if len(lps) != len(ids):
            raise UserError(f"{self.url}/v1/completions returned {len(ids)} tokens but "
                            f"{len(lps)} log-probs: it must honour logprobs=0")
        finished = choice.get("finish_reason") == "stop"
        if finished and (not ids or ids[-1] not in self.stop_ids):
            ids, lps = [*ids, self.stop_ids[0]], [*lps, math.nan]
        name = resp.get("model") or self.loaded
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Completion(list(prompt), list(ids), lps, text, finished,
                          {"adapter": name, "adapter_version": self._version_of(name)})

    def _version_of(self, name: str) -> int:
        head, _, tail = name.rpartition("-step")
        if head == self.prefix and tail.isdigit():
            return int(tail)
        raise UserError(f"{self.url}: a completion came from {name!r}, not from an adapter "
                        f"this run pushed ({self.prefix}-stepNNNNNN)")

    def served(self) -> list[str]:
        """Model ids the server lists (`GET /v1/models`): the base model and loaded LoRAs."""
        return [m.get("id") for m in self.call("/v1/models", None).get("data", [])]

    def call(self, route: str, body: dict[str, Any] | None) -> dict[str, Any]:
        """POST `body` as JSON to the server (GET when it is None); any failure becomes one
        `UserError` naming the URL and the fix."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + route, data=data,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as res:
                raw = res.read().decode()
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:500]
            raise UserError(f"rollout server {self.url}{route}: HTTP {exc.code}: {detail} "
                            "(vLLM needs --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                            "for adapter loading)") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as exc:
            raise UserError(f"rollout server {self.url}{route}: unreachable ({exc}); start it "
                            "(`selfdistill serve` or `vllm serve --enable-lora`) or fix "
                            "rollout.url") from None
        try:
            return json.loads(raw) if raw.strip().startswith(("{", "[")) else {"text": raw}
        except json.JSONDecodeError:
            return {"text": raw}


def _token_id(token: str) -> int:
    """'token_id:123' (vLLM's `return_tokens_as_token_ids`) → 123."""
    if isinstance(token, int):
        return token
    if not token.startswith("token_id:"):
        raise ValueError(f"token {token!r} is not 'token_id:N'")
    return int(token.split(":", 1)[1])


def _save_adapter(model: Any, path: Path) -> None:
    """Write the PEFT adapter to `path` atomically (temporary name, then rename)."""
    tmp = path.with_name(f".tmp_{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
