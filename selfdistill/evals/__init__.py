"""Evaluation: strict task accuracy, forgetting probes, and the reports built from them."""

from selfdistill.evals.accuracy import EvalReport, evaluate

__all__ = ["EvalReport", "evaluate"]
