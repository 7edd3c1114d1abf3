"""Who the teacher is: its context (templates), its weights (regimes), and how it scores tokens."""

from selfdistill.teacher.contexts import (
    FEEDBACK_ALIASES,
    KINDS,
    ContextTemplates,
    PrivilegedContext,
    TeacherPrompt,
    build_teacher_messages,
    truncate_text,
)
from selfdistill.teacher.model_teacher import ModelRegime, check_tokenizers, load_teacher
from selfdistill.teacher.prompt_cache import PromptCache
from selfdistill.teacher.regimes import (
    REGIMES,
    BaseRegime,
    EmaRegime,
    LiveRegime,
    TeacherRegime,
    TrustRegionRegime,
    make_regime,
    model_logits,
    teacher_mode,
)
from selfdistill.teacher.scoring import (
    PackedBatch,
    ScoredBatch,
    build_batch,
    completion_logits,
    length_groups,
    score_completions,
)

__all__ = [
    "FEEDBACK_ALIASES",
    "KINDS",
    "REGIMES",
    "BaseRegime",
    "ContextTemplates",
    "EmaRegime",
    "LiveRegime",
    "ModelRegime",
    "PackedBatch",
    "PrivilegedContext",
    "PromptCache",
    "ScoredBatch",
    "TeacherPrompt",
    "TeacherRegime",
    "TrustRegionRegime",
    "build_batch",
    "build_teacher_messages",
    "check_tokenizers",
    "completion_logits",
    "length_groups",
    "load_teacher",
    "make_regime",
    "model_logits",
    "score_completions",
    "teacher_mode",
    "truncate_text",
]
