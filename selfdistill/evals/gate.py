"""The promotion gate of a training run: the task must improve, the probes must not be forgotten.

Rule (defaults from `GateConfig`): promote only if accuracy on the task suite rose by more than
`min_improvement` (absolute fraction) AND the number of forgetting probes answered correctly fell
by at most `probe_tolerance`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class GateCheck:
    name: str
    passed: bool
    before: float
    after: float
    rule: str


@dataclass
class GateVerdict:
    promote: bool
    checks: list[GateCheck] = field(default_factory=list)

    @property
    def summary(self) -> str:
        word = "PROMOTE" if self.promote else "REJECT"
        failed = [c.name for c in self.checks if not c.passed]
        return word + (f" (failed: {', '.join(failed)})" if failed else "")

    def to_dict(self) -> dict[str, Any]:
        return {"promote": self.promote, "summary": self.summary,
                "checks": [asdict(c) for c in self.checks]}


def decide(before: dict[str, dict], after: dict[str, dict], *, task: str,
           min_improvement: float, probe_tolerance: int) -> GateVerdict:
    """`before` / `after` map suite name → {"accuracy", "correct", "n"}; "probes" is the
    forgetting-probe suite (absent = that check is skipped and said so in its rule)."""
    checks = []
    if task not in before or task not in after:
        raise KeyError(f"gate task suite {task!r} was not evaluated; evaluated: {sorted(after)}")
    b, a = before[task]["accuracy"], after[task]["accuracy"]
    checks.append(GateCheck(f"task:{task}", a - b > min_improvement, b, a,
                            f"accuracy gain > {min_improvement:g}"))
    if "probes" in before and "probes" in after:
        lost = before["probes"]["correct"] - after["probes"]["correct"]
        checks.append(GateCheck("forgetting_probes", lost <= probe_tolerance,
                                before["probes"]["correct"], after["probes"]["correct"],
                                f"probes lost ≤ {probe_tolerance}"))
    return GateVerdict(all(c.passed for c in checks), checks)
