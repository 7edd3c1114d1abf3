"""The server's one typed config: YAML file + `key=value` overrides, like training's.

Every field is documented once, here (units; what 0 / None means). `selfdistill serve
--help-config` prints them. Unknown keys and wrong types fail before any model is loaded.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from selfdistill.train.config import describe_fields, load_config

ADMIN_TOKEN_ENV = "SELFDISTILL_ADMIN_TOKEN"
LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class LimitsConfig(_Section):
    max_request_bytes: int = Field(1_000_000, gt=0, description="largest request body (bytes); "
                                   "larger ones get 413")
    max_message_chars: int = Field(20_000, gt=0, description="longest message or prompt text "
                                   "(characters); longer ones get 400")
    max_prompt_tokens: int = Field(1536, gt=0, description="longest prompt after the chat "
                                   "template (tokens)")
    max_tokens: int = Field(512, gt=0, description="largest max_tokens a request may ask for")
    default_max_tokens: int = Field(128, gt=0, description="max_tokens when a request names none")


class GovernanceConfig(_Section):
    consent_default: bool = Field(False, description="learning consent of a tenant nobody has "
                                  "asked (false = opt-in: nothing is stored for training until "
                                  "the tenant or an operator turns it on)")
    consent: dict[str, bool] = Field(default_factory=dict, description="per-scope consent set "
                                     "by the operator at start, e.g. {'user:alice': true}")
    redact: bool = Field(True, description="redact PII (emails, phones, card numbers, IBANs, IP "
                         "addresses) before anything is stored or trained on")
    lessons_per_hour: int = Field(60, ge=0, description="lessons a tenant may add per rolling "
                                  "hour (0 = none); explicit feedback over it gets 429, "
                                  "implicit follow-ups over it are dropped")


class LearnerConfig(_Section):
    enabled: bool = Field(True, description="run the background learner")
    threshold: float = Field(0.05, ge=0, description="a feedback candidate is a lesson when the "
                             "model's own teacher/student divergence on its response under the "
                             "feedback context exceeds this (mean nats per token)")
    implicit: bool = Field(True, description="pair a user's next message with the previous "
                           "assistant turn as a feedback candidate")
    every_lessons: int = Field(4, gt=0, description="learn once a tenant has this many accepted "
                               "lessons not yet trained on")
    idle_seconds: float = Field(60.0, ge=0, description="...or when its newest accepted lesson is "
                                "this old (0 = only every_lessons)")
    poll_seconds: float = Field(1.0, gt=0, description="how often the learner looks for work")
    steps: int = Field(8, gt=0, description="optimizer steps per learning round")
    batch_size: int = Field(4, gt=0, description="lessons per step")
    learning_rate: float = Field(1e-3, gt=0, description="AdamW learning rate")
    max_new_tokens: int = Field(48, gt=0, description="rollout budget per lesson (tokens)")
    temperature: float = Field(1.0, gt=0, description="rollout sampling temperature")
    lora_rank: int = Field(8, gt=0, description="LoRA rank of tenant adapters")
    anchor_batch_size: int = Field(8, ge=0, description="builtin anchor prompts per step (0 = "
                                   "none): rolled out without feedback and distilled toward "
                                   "the base model, which holds general behaviour in place "
                                   "(the main job's recipe)")
    anchor_weight: float = Field(2.0, ge=0, description="weight of the anchor rows' divergence "
                                 "next to the lessons'")
    precision: Literal["float32", "bfloat16", "auto"] = Field(
        "float32", description="training forward precision, as the trainer's `precision` "
        "(bfloat16 = autocast; auto = bfloat16 only where the device has native bf16)")
    threads: int | None = Field(None, gt=0, description="torch threads while learning; None = "
                                "leave as is")
    probes: list[str] = Field(default_factory=lambda: ["builtin"], description="forgetting "
                              "probe JSONL files of the promotion gate ('builtin' = packaged)")
    probe_tolerance: int = Field(1, ge=0, description="probes a promotion may lose")
    gate_max_new_tokens: int = Field(24, gt=0, description="greedy answer budget of the gate")
    require_lesson_fit: bool = Field(True, description="the gate also requires the candidate "
                                     "to fit the round's lessons better than the active "
                                     "version (lower divergence to the feedback-informed "
                                     "teacher)")


class ServeConfig(_Section):
    model: str | None = Field(None, description="HF model directory or hub id; None = the "
                              "embedded SmolLM2-135M-Instruct")
    served_model_name: str | None = Field(None, description="the `model` id clients send and "
                                          "/v1/models lists; None = the model's name")
    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, lt=65536, description="TCP port (0 = any free one)")
    home: str | None = Field(None, description="server state directory (registry.db with the "
                             "serve tables, adapters/, runs/); None = $SELFDISTILL_HOME, else "
                             "./.selfdistill")
    registry: str | None = Field(None, description="registry database path or URL; None = "
                                 "HOME/registry.db")
    admin_token: str | None = Field(None, description="bearer token of /admin; None = "
                                    f"${ADMIN_TOKEN_ENV}; unset = admin API refused")
    lora_updates: bool = Field(False, description="enable /v1/load_lora_adapter and "
                               f"/v1/unload_lora_adapter (also on with {LORA_ENV}=true, as vLLM)")
    threads: int | None = Field(None, gt=0, description="torch CPU threads; None = all cores")
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    governance: GovernanceConfig = Field(default_factory=GovernanceConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)

    def home_dir(self) -> Path:
        """The state directory (created)."""
        home = self.home or os.environ.get("SELFDISTILL_HOME") or ".selfdistill"
        path = Path(home).expanduser().resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path

    def token(self) -> str | None:
        """The admin bearer token in force (config, else environment)."""
        return self.admin_token or os.environ.get(ADMIN_TOKEN_ENV) or None

    def lora_updates_enabled(self) -> bool:
        """Whether runtime LoRA loading is allowed (config or vLLM's environment variable)."""
        return self.lora_updates or os.environ.get(LORA_ENV, "").lower() in ("1", "true")


def load_serve_config(path: str | None, overrides: list[str] | None = None) -> ServeConfig:
    """A config from an optional YAML file plus `key=value` overrides (ConfigError if bad)."""
    return load_config(path, overrides or [], schema=ServeConfig)


def help_text() -> str:
    """Every field with its description, for `--help-config`."""
    return "\n".join(describe_fields(ServeConfig))


def dump(cfg: ServeConfig) -> dict[str, Any]:
    """JSON-ready config without secrets."""
    out = cfg.model_dump(mode="json")
    out["admin_token"] = "***" if cfg.token() else None
    return out
