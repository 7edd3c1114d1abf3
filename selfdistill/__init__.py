"""selfdistill: on-policy self-distillation of language models.

The data flow, one module per step (see README "Where things live"):
prompt (`data`) → attempt (`rollout`) → feedback (`envs`) → teacher context (`teacher`)
→ signal (`losses`) → adapter (`train`, `models`) → gate (`evals`).
"""

__version__ = "0.1.0"
