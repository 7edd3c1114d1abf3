"""Rollouts: the student samples completions on-policy (generation backends live here)."""

from selfdistill.rollout.hf import Completion, generate

__all__ = ["Completion", "generate"]
