"""A small world for registry tests: a tiny base model that answers the forgetting probes correctly
by construction, run directories holding LoRA adapters, and a deliberately harmful adapter.

Construction: a tiny random Llama (real tokenizer) is fitted for a few steps to answer every probe
question with " Paris"; the probe file's answer is "Paris", so the base scores 21/21. The task
suite asks the knowledge questions with the answer "banana", which the base never says. The
harmful adapter is LoRA trained with cross-entropy on the task questions only to answer
" banana": it improves the task suite and generalizes to every question, forgetting the probes.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from selfdistill.chat import prompt_ids, to_messages
from selfdistill.data import load_rows
from selfdistill.models import attach_lora
from selfdistill.rollout import generate
from selfdistill.store import TraceStore
from tests.conftest import make_tiny_model

REPO = Path(__file__).resolve().parents[1]
PROBES = REPO / "selfdistill" / "data" / "probes.jsonl"
KNOWLEDGE = REPO / "examples" / "knowledge" / "train.jsonl"
MAX_NEW = 8
PROMPTS = ["What is the capital of France?", "Who wrote Hamlet?", "Name a colour."]


def _fit(
    model, tok, prompts: list[list[int]], word: str | list[str], *, steps: int, lr: float
) -> None:
    """Cross-entropy on `word` repeated MAX_NEW times after each prompt (left-padded batch);
    a list gives each prompt its own word (all of one token's length)."""
    words = [word] * len(prompts) if isinstance(word, str) else word
    targets = [tok(w, add_special_tokens=False)["input_ids"] * MAX_NEW for w in words]
    seqs = [p + t for p, t in zip(prompts, targets, strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :], mask[i, width - len(s) :] = torch.tensor(s), 1
    labels = torch.tensor(targets)  # (B, T)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=lr)
    model.train()
    for _ in range(steps):
        logits = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
            logits_to_keep=labels.shape[1] + 1,
        ).logits[:, :-1]  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def answers(model, tok, questions: list[str]) -> list[str]:
    """Greedy completions (MAX_NEW tokens)."""
    ids = [prompt_ids(tok, to_messages(q)) for q in questions]
    return [c[0].text for c in generate(model, tok, ids, greedy=True, max_new_tokens=MAX_NEW)]


def behaviour(model, tok) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy token ids on PROMPTS and the full logits of the first prompt."""
    ids = [prompt_ids(tok, to_messages(q)) for q in PROMPTS]
    outs = generate(model, tok, ids, greedy=True, max_new_tokens=MAX_NEW)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[0]])).logits  # (1, T, V)
    return [c[0].token_ids for c in outs], logits


def same(a, b) -> bool:
    """Bit-identical behaviour: equal greedy ids and exactly equal logits."""
    return a[0] == b[0] and torch.equal(a[1], b[1])


class World:
    """Paths of the constructed base, suites and the harmful adapter (built once per module)."""

    def __init__(self, root: Path, tokenizer) -> None:
        self.root, self.tok = root, tokenizer
        probe_qs = [r.messages[-1]["content"] for r in load_rows(PROBES)]
        task_qs = [r.messages[-1]["content"] for r in load_rows(KNOWLEDGE)][:8]
        self.probes = self._jsonl("probes.jsonl", probe_qs, "Paris")
        self.task = self._jsonl("task.jsonl", task_qs, "banana")
        base = make_tiny_model()
        _fit(
            base,
            tokenizer,
            [prompt_ids(tokenizer, to_messages(q)) for q in probe_qs],
            " Paris",
            steps=6,
            lr=1e-2,
        )
        assert all("Paris" in a for a in answers(base, tokenizer, probe_qs)), "construction"
        self.base_dir = root / "base"
        base.save_pretrained(self.base_dir)
        tokenizer.save_pretrained(self.base_dir)
        torch.manual_seed(0)
        harmful = attach_lora(copy.deepcopy(base), rank=4)
        _fit(
            harmful,
            tokenizer,
            [prompt_ids(tokenizer, to_messages(q)) for q in task_qs],
            " banana",
            steps=30,
            lr=2e-2,
        )
        said = answers(harmful, tokenizer, probe_qs + task_qs)
        assert all("banana" in a and "Paris" not in a for a in said), said
        self.harmful_adapter = root / "harmful_adapter"
        harmful.save_pretrained(self.harmful_adapter)

    def _jsonl(self, name: str, questions: list[str], answer: str) -> Path:
        path = self.root / name
        path.write_text(
            "".join(json.dumps({"prompt": q, "answer": answer}) + "\n" for q in questions)
        )
        return path

    def config(self, scope: str) -> dict:
        """A training config as `selfdistill train` records it (the fields the registry reads)."""
        return {
            "model": str(self.base_dir),
            "scope": scope,
            "method": "sdft",
            "train_data": str(self.task),
            "eval_data": {},
            "probe_data": str(self.probes),
            "gate": {"task": "train", "min_improvement": 0.0, "probe_tolerance": 1},
            "eval": {"max_new_tokens": MAX_NEW, "batch_size": 16},
        }

    def run(
        self,
        run_dir: Path,
        *,
        scope: str = "global",
        seed: int = 0,
        scale: float = 0.0,
        harmful: bool = False,
        attempts: int = 2,
    ) -> Path:
        """A finished run directory at `run_dir`: adapter/ (LoRA B ~ N(0, scale), or zero: the
        base's exact behaviour; or the harmful one), summary.json, traces.db with one step."""
        name = run_dir.name
        run_dir.mkdir(parents=True)
        if harmful:
            (run_dir / "adapter").mkdir()
            for f in ("adapter_model.safetensors", "adapter_config.json"):
                (run_dir / "adapter" / f).write_bytes((self.harmful_adapter / f).read_bytes())
        else:
            torch.manual_seed(seed)  # LoRA A's initialization
            peft = attach_lora(make_tiny_model(), rank=4)
            gen = torch.Generator().manual_seed(seed)
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.data.copy_(torch.randn(p.shape, generator=gen) * scale)
            peft.save_pretrained(run_dir / "adapter")
        config = self.config(scope)
        with TraceStore(path=run_dir) as store:
            run_id = store.create_run(name, scope=scope, config=config)
            rows = [
                {
                    "prompt": to_messages(f"q{i}"),
                    "completion": "a",
                    "completion_ids": [1],
                    "step": 1,
                }
                for i in range(attempts)
            ]
            ids = store.add_attempts(run_id, rows)
            store.record_step(run_id, 1, ids)
        (run_dir / "run_id").write_text(run_id)
        summary = {
            "model": str(self.base_dir),
            "model_path": str(self.base_dir),
            "steps": 1,
            "config": config,
            "before": {"train": {"accuracy": 0.0, "correct": 0, "n": 8}},
            "after": {"train": {"accuracy": 0.125 * seed, "correct": seed, "n": 8}},
            "gate": {"promote": False, "summary": "REJECT (failed: task:train)", "checks": []},
            "adapter": str(run_dir / "adapter"),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary))
        return run_dir


@pytest.fixture(scope="module")
def world(tmp_path_factory, tokenizer) -> World:
    """The constructed world, shared by a test module (nothing in it is modified by tests)."""
    return World(tmp_path_factory.mktemp("world"), tokenizer)
