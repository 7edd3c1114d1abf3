"""Training: the on-policy loop (`loop`), its methods (`methods`), config, checkpoints, metrics."""

from selfdistill.train.config import TrainConfig, load_config
from selfdistill.train.run import run_training

__all__ = ["TrainConfig", "load_config", "run_training"]
