"""The adapter registry: immutable, content-addressed adapter versions with their lineage (run,
data ids, config, metrics), evaluation gates, promotion per scope (tenant), rollback, and
resolution at inference (user → workspace → global → base). See docs/registry.md.

    reg = Registry()                                   # $SELFDISTILL_HOME or ./.selfdistill
    v = reg.propose("runs/knowledge")["id"]            # scope: the run's
    reg.promote(v)                                     # gate vs the active version, then activate
    reg.rollback("global")                             # back to the previous one, atomically
    lm, res = reg.load_resolved(user="alice", workspace="acme")

Modules: `registry` (`Registry`: reads), `lifecycle` (changes), `base` (location, locks), `gate`
(gate specs and evaluation), `weights` (content-addressed files), `runs` (reading a run
directory), `queries` (reads), `views` (text and mermaid), `cli`.
"""

from selfdistill.registry.base import default_location
from selfdistill.registry.gate import GateOutcome, GateSpec, TaskSuite, default_spec, load_spec
from selfdistill.registry.lifecycle import BASE, PromotionConflict
from selfdistill.registry.registry import Registry, Resolution
from selfdistill.registry.weights import WeightStore, adapter_id

__all__ = [
    "BASE",
    "GateOutcome",
    "GateSpec",
    "PromotionConflict",
    "Registry",
    "Resolution",
    "TaskSuite",
    "WeightStore",
    "adapter_id",
    "default_location",
    "default_spec",
    "load_spec",
]
