"""The one typed config of a training job: YAML file + `key=value` overrides.

Every field is documented once, here, in its `description` (units; what 0 / None means).
`selfdistill train --help-config` prints them. Unknown keys, wrong types and unknown choices
fail before any model is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from selfdistill.errors import ConfigError

Method = Literal["sdft", "sdpo", "grpo", "sft", "cpt"]
Regime = Literal["base", "live", "ema", "trust_region", "model"]
Estimator = Literal["full", "topk", "sampled"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LoraConfig(_Section):
    enabled: bool = Field(True, description="train a LoRA adapter; false = full fine-tuning")
    rank: int = Field(16, gt=0, description="LoRA rank r")
    alpha: float = Field(32.0, gt=0, description="LoRA scaling numerator (scale = alpha / rank)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the LoRA input")
    target_modules: str | list[str] = Field(
        "all-linear", description="module names to adapt; 'all-linear' = every linear layer "
        "except the output head")


class TeacherConfig(_Section):
    regime: Regime = Field("base", description="teacher weights: base (frozen initial weights, "
                           "adapter disabled), live (current student), ema, trust_region, "
                           "model (another model: teacher.model; on-policy distillation)")
    model: str | None = Field(None, description="regime=model: the teacher's HF directory (or "
                              "hub id; 'default' = the embedded model); it must use the "
                              "student's tokenizer. None = no second model")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="regime=model: the "
                                                  "teacher's weight and forward precision")
    context: Literal["same_as_self_distillation", "none"] = Field(
        "same_as_self_distillation", description="what the teacher reads: the method's "
        "privileged context (demonstration, feedback, system prompt ...), or none = the "
        "student's prompt only (classic on-policy distillation; needs regime=model)")
    rate: float = Field(0.05, ge=0, le=1, description="EMA rate r (teacher ← (1−r)·teacher + "
                        "r·student per step) or trust-region mix r (logits = lerp(base, live, r))")
    max_context_tokens: int | None = Field(
        None, gt=0, description="cap on privileged-context tokens; None = no cap")
    truncate: Literal["left", "right"] = Field(
        "right", description="which end of an over-long context is cut")
    prompt_cache_mb: int = Field(1024, ge=0, description="frozen teachers (regime base or "
                                 "model): compute the keys and values of the teacher prompts "
                                 "known before training (anchors; sdft rows) once, up to this "
                                 "many MiB, so each step runs the teacher over those rows' "
                                 "completions only; 0 = off")


class LossConfig(_Section):
    estimator: Estimator = Field("full", description="full vocabulary, topk (student's top-k "
                                 "plus a tail bucket) or sampled (sampled token only; reverse KL)")
    alpha: float = Field(0.5, ge=0, le=1, description="0 = forward KL(teacher‖student), "
                         "1 = reverse KL(student‖teacher), between = generalized JSD")
    topk: int = Field(100, gt=0, description="k for estimator=topk")
    add_tail: bool = Field(True, description="topk: add one bucket with the remaining mass")
    chunk_size: int | None = Field(128, gt=0, description="rows (tokens) per chunk of the "
                                   "divergence, computed with a closed-form backward that "
                                   "writes the gradient over the student logits' row copy "
                                   "(less memory, and about 2x faster than autograd on a CPU); "
                                   "None = plain autograd")
    distillation_weight: float = Field(1.0, ge=0, le=1, description="sdpo: 1 = pure "
                                       "distillation, 0 = pure GRPO, between = mix")
    anchor_weight: float = Field(1.0, ge=0, description="weight of the anchor rows' token-mean "
                                 "divergence next to the task rows' (see anchor_data)")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range of the GRPO term")
    importance_clip: float = Field(2.0, gt=0, description="upper clamp of the importance "
                                   "ratio when updates_per_batch > 1")


class SdpoConfig(_Section):
    success_threshold: float = Field(1.0, description="reward at or above which an attempt "
                                     "is a success (its text may teach its siblings)")
    sibling_solutions: bool = Field(True, description="a successful sibling becomes the "
                                    "teacher's `solution` context for failed siblings")
    include_self: bool = Field(False, description="a successful attempt may be its own "
                               "solution context (off as in the SDPO reference)")
    feedback_for_successes: bool = Field(False, description="also distill successful attempts "
                                         "under their own (positive) feedback")
    environment_feedback: bool = Field(True, description="the grader's feedback text goes into "
                                       "failed attempts' teacher context; false = only "
                                       "successful siblings teach")
    reveal_answer: bool = Field(True, description="QA feedback names the expected answer")


class EvalConfig(_Section):
    every_steps: int = Field(0, ge=0, description="evaluate the task sets every N steps "
                             "(0 = only before and after training)")
    max_new_tokens: int = Field(64, gt=0, description="greedy answer budget (tokens)")
    batch_size: int = Field(64, gt=0, description="prompts per generation batch (filled "
                            "across suites; on a CPU a decode step of 64 rows costs ~1.5x "
                            "one of 16)")
    oracle: bool = Field(True, description="also evaluate the teacher's ceiling: the base "
                         "model with the privileged context in its prompt")


class GateConfig(_Section):
    task: str = Field("train", description="name of the eval set that must improve")
    min_improvement: float = Field(0.0, description="required accuracy gain on `task` "
                                   "(strictly greater than this, absolute fraction)")
    probe_tolerance: int = Field(1, ge=0, description="forgetting probes that may be lost")


class RolloutConfig(_Section):
    backend: Literal["hf", "server"] = Field(
        "hf", description="where rollouts are sampled: hf = in-process HF generate on the "
        "learner's own weights; server = an OpenAI-compatible completions server returning "
        "token log-probs, with dynamic LoRA loading (`vllm serve --enable-lora` or "
        "`selfdistill serve`), see docs/distributed.md")
    fold_lora: bool = Field(True, description="backend=hf: decode through LoRA-folded weights "
                            "(W + s·B·A in a temporary copy, adapter layers off; the same "
                            "function up to float rounding, ~2x faster CPU decoding; costs one "
                            "copy of the adapted weights while generating); false = through "
                            "PEFT's adapter layers")
    pack_weights: bool = Field(True, description="backend=hf on a CPU: decode through oneDNN-"
                               "packed copies of the frozen linear weights (the same function "
                               "up to float rounding; ~1.5x faster decoding measured on an AVX2 "
                               "EPYC; one copy of those weights while generating); false = "
                               "PyTorch's default CPU matmul")
    decode_loop: bool = Field(True, description="backend=hf, Llama / Qwen2 models: greedy and "
                              "seeded decoding run selfdistill's own decode loop over the "
                              "model's layers instead of HF generate (the same function up to "
                              "float rounding; less per-step overhead); false = HF generate")
    url: str | None = Field(None, description="backend=server: the server's base URL, e.g. "
                            "http://127.0.0.1:8000 (the /v1 routes are appended)")
    push_every: int = Field(1, gt=0, description="backend=server: push the adapter every K "
                            "steps; between pushes samples lag the learner by up to K−1 steps "
                            "and are importance-corrected with the server's log-probs")
    push_dir: str | None = Field(None, description="backend=server: directory, readable by "
                                 "the server, where pushed adapters are written; None = "
                                 "OUTPUT_DIR/pushed")
    adapter_name: str = Field("selfdistill", pattern=r"^[A-Za-z0-9_.-]+$", description="prefix "
                              "of the served adapter names: NAME-stepNNNNNN")
    timeout: float = Field(300.0, gt=0, description="backend=server: seconds per HTTP request")
    concurrency: int = Field(16, gt=0, description="backend=server: completion requests in "
                             "flight per process")


class TrainConfig(_Section):
    # -- common knobs --------------------------------------------------------------------
    model: str | None = Field(None, description="HF model directory or hub id; None = the "
                              "embedded SmolLM2-135M-Instruct")
    method: Method = Field("sdft", description="sdft | sdpo | grpo | sft | cpt")
    train_data: str = Field(..., description="training JSONL (columns depend on method)")
    eval_data: dict[str, str] = Field(default_factory=dict, description="named evaluation "
                                      "JSONL files; 'train' = the training questions")
    probe_data: str | None = Field("builtin", description="forgetting probes JSONL; "
                                   "'builtin' = the packaged general-knowledge probes, "
                                   "None = no probes")
    anchor_data: str | None = Field(None, description="anchor prompts JSONL (`prompt` column; "
                                    "'builtin' = packaged general questions, disjoint from "
                                    "the probes): on-policy rollouts on them are distilled "
                                    "toward the teacher with NO privileged context, which "
                                    "pulls the student back to the teacher's (with "
                                    "regime=base: the base model's) general behaviour")
    anchor_batch_size: int = Field(0, ge=0, description="anchor prompts per step (one rollout "
                                   "each); 0 = no anchors")
    anchor_source: Literal["student", "base"] = Field(
        "student", description="who writes the anchors' completions: student = on-policy "
        "rollouts every step (the divergence where the student goes); base = one sample per "
        "anchor prompt from the initial weights (adapter off), drawn once and reused, so the "
        "loss is the sequence-level KL(base‖student) on the base model's own answers (needs "
        "lora.enabled)")
    output_dir: str = Field("runs/latest", description="run directory (metrics, adapter, "
                            "checkpoints, report)")
    seed: int = Field(0, description="seed for data order, sampling and initialization")
    steps: int = Field(40, ge=0, description="optimizer steps")
    batch_size: int = Field(8, gt=0, description="prompts per step")
    num_generations: int = Field(1, gt=0, description="completions per prompt (group size)")
    max_new_tokens: int = Field(48, gt=0, description="rollout budget (tokens)")
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature")
    top_p: float = Field(1.0, gt=0, le=1, description="rollout nucleus mass")
    learning_rate: float = Field(5e-4, gt=0, description="peak learning rate (AdamW)")
    # -- advanced ------------------------------------------------------------------------
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up steps")
    lr_schedule: Literal["constant", "cosine"] = Field("constant", description="after warm-up")
    max_grad_norm: float | None = Field(1.0, gt=0, description="gradient clip; None = off")
    updates_per_batch: int = Field(1, gt=0, description="optimizer steps per rollout batch "
                                   "(>1 uses importance-ratio clipping)")
    micro_batch_size: int | None = Field(
        None, gt=0, description="rows per student forward+backward; the update is split into "
        "micro-batches whose losses are weighted by their token share, so the gradient equals "
        "the full batch's (less peak memory, same result); None = the whole batch at once")
    precision: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="forward-pass precision: bfloat16 = autocast (matmuls in bf16, "
        "about 2× faster on CPUs with AVX512-BF16/AMX and on recent GPUs; weights, optimizer "
        "and losses stay float32; on a CPU without native bf16 it is emulated and tens of "
        "times SLOWER); auto = bfloat16 where the device runs it natively, else float32")
    base_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="dtype of the frozen base weights: bfloat16 halves their memory "
        "(LoRA weights, optimizer state and losses stay float32; needs lora.enabled)")
    share_prefix: bool = Field(True, description="score the prompts' common leading tokens (a "
                               "chat template's system prompt) once per forward instead of once "
                               "per row: same logits and gradients, ~1/3 fewer student and "
                               "teacher token-forwards on the default model; off under data "
                               "parallelism and gradient checkpointing")
    gradient_checkpointing: bool = Field(False, description="recompute each layer's activations "
                                         "in the backward pass: activation memory from "
                                         "O(layers) to O(1) layers, for one more forward per "
                                         "layer")
    threads: int | None = Field(None, gt=0, description="torch CPU threads; None = all cores")
    device: str = Field("auto", pattern=r"^(auto|cpu|cuda(:\d+)?|mps)$", description="where the "
                        "model runs: cpu, cuda, cuda:N, mps; auto = cuda when available, else cpu")
    checkpoint_every: int = Field(10, ge=0, description="checkpoint every N steps (0 = only "
                                  "at the end); `traces replay` needs the checkpoint before a step")
    trace_store: str | None = Field("run", description="where attempts, feedback, teacher "
                                    "contexts and steps are recorded: 'run' = SQLite file "
                                    "OUTPUT_DIR/traces.db, an SQLAlchemy URL, or None = off")
    registry: str | None = Field(None, description="after training, propose the adapter as a "
                                 "version of `scope` in this adapter registry: 'default' "
                                 "($SELFDISTILL_HOME/registry.db, else ./.selfdistill/), a "
                                 "path or a database URL; None = do not propose")
    scope: str = Field("global", description="whose adapter this is: global, "
                       "workspace:<id> or user:<id> (recorded with the run)")
    lora: LoraConfig = Field(default_factory=LoraConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    sdpo: SdpoConfig = Field(default_factory=SdpoConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    gate: GateConfig = Field(default_factory=GateConfig)

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        if self.loss.estimator == "sampled" and self.loss.alpha != 1.0:
            raise ValueError("loss.estimator=sampled estimates reverse KL only: set loss.alpha=1")
        if self.method in ("sdpo", "grpo") and self.num_generations < 2:
            raise ValueError(f"method={self.method} compares attempts within a group: "
                             "set num_generations >= 2")
        if self.micro_batch_size:
            _check_micro_batch(self)
        if (self.teacher.regime == "model") != (self.teacher.model is not None):
            raise ValueError("teacher.regime=model and teacher.model go together: name the "
                             "teacher's model directory with teacher.model=PATH, or pick "
                             "another regime and drop teacher.model")
        if self.teacher.context == "none" and self.teacher.regime != "model":
            raise ValueError("teacher.context=none makes the teacher read the student's own "
                             "prompt: with the student's weights that is no signal; use "
                             "teacher.regime=model")
        if self.base_dtype != "float32" and not self.lora.enabled:
            raise ValueError("base_dtype=bfloat16 keeps the *frozen* weights in bfloat16: with "
                             "full fine-tuning (lora.enabled=false) use precision=bfloat16")
        if self.rollout.backend == "server":
            if not self.rollout.url:
                raise ValueError("rollout.backend=server needs rollout.url (the completions "
                                 "server's base URL, e.g. http://127.0.0.1:8000)")
            if not self.lora.enabled:
                raise ValueError("rollout.backend=server pushes LoRA adapters to the server: "
                                 "set lora.enabled=true (or rollout.backend=hf)")
        if self.anchor_batch_size:
            if self.anchor_data is None:
                raise ValueError("anchor_batch_size > 0 needs anchor_data (a JSONL of prompts, "
                                 "or 'builtin')")
            if self.method not in ("sdft", "sdpo", "grpo"):
                raise ValueError(f"anchors are on-policy rollouts: method={self.method} makes "
                                 "none (use sdft, sdpo or grpo, or set anchor_batch_size=0)")
            if self.anchor_source == "base" and not self.lora.enabled:
                raise ValueError("anchor_source=base samples the initial weights with the "
                                 "adapter switched off: it needs lora.enabled=true")
            if self.teacher.regime == "live":
                raise ValueError("with teacher.regime=live the anchor teacher IS the student "
                                 "(zero loss): use base, ema or trust_region")
        return self


def _check_micro_batch(cfg: TrainConfig) -> None:
    """Micro-batching is exact where every loss term keeps its rows whole (train/microbatch.py)."""
    if cfg.method == "sdpo" and 0 < cfg.loss.distillation_weight < 1:
        raise ValueError("micro_batch_size with an sdpo distillation/GRPO mix is not supported: "
                         "set loss.distillation_weight to 0 or 1, or micro_batch_size=null")
    pg = cfg.method == "grpo" or (cfg.method == "sdpo" and cfg.loss.distillation_weight == 0)
    if pg and cfg.micro_batch_size % cfg.num_generations:
        raise ValueError(f"micro_batch_size={cfg.micro_batch_size} must be a multiple of "
                         f"num_generations={cfg.num_generations} (whole GRPO groups)")


# Columns each method needs in every training row, checked before any model is loaded.
REQUIRED_COLUMNS: dict[str, tuple[str, ...]] = {
    "sdft": ("prompt", "privileged_context"),
    "sft": ("prompt", "privileged_context"),
    "cpt": ("privileged_context",),
    "sdpo": ("prompt",),  # plus a grader: `answer` or `tests` (checked by the loader)
    "grpo": ("prompt",),
}


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {key}: {p} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None, overrides: list[str] = (),
                schema: type[BaseModel] | None = None) -> Any:
    """Read a YAML config and apply `key=value` / `section.key=value` overrides.

    `schema` is the config class (default `TrainConfig`; `selfdistill serve` passes its own).

    Values are parsed as YAML (so `steps=10` is an int, `model=null` is None). Relative data
    paths in the file are resolved against the file's directory.
    """
    tree: dict[str, Any] = {}
    base = Path.cwd()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: no such config file")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path}: not valid YAML: {exc}") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
        base = path.parent
        _resolve_paths(tree, base)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value (e.g. steps=10)")
        key, raw = item.split("=", 1)
        value = yaml.safe_load(raw) if raw else ""
        _set_dotted(tree, key.strip(), value)
    try:
        return (schema or TrainConfig).model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_format_validation(exc, path)) from None


def _resolve_paths(tree: dict[str, Any], base: Path) -> None:
    def fix(p: Any) -> Any:
        if isinstance(p, str) and p not in ("builtin",) and not Path(p).is_absolute():
            return str((base / p).resolve()) if (base / p).exists() else p
        return p

    for key in ("train_data", "probe_data", "anchor_data"):
        if key in tree:
            tree[key] = fix(tree[key])
    if isinstance(tree.get("teacher"), dict) and "model" in tree["teacher"]:
        tree["teacher"]["model"] = fix(tree["teacher"]["model"])
    if isinstance(tree.get("eval_data"), dict):
        tree["eval_data"] = {k: fix(v) for k, v in tree["eval_data"].items()}


def _format_validation(exc: ValidationError, path: Path | None) -> str:
    where = f"{path}: " if path else ""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "config"
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key (see --help-config)"
        lines.append(f"{loc}: {msg}")
    return where + "invalid config: " + "; ".join(lines)


def describe_fields(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """One line per config field: dotted name, default, description."""
    out = []
    for name, f in model.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(describe_fields(ann, f"{prefix}{name}."))
            continue
        default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
        out.append(f"{prefix}{name} = {default}  — {f.description or ''}")
    return out
