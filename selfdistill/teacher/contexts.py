"""Teacher contexts: the student's chat messages plus privileged context, as the teacher's messages.

The teacher is the same model re-reading the same request with something the student did not
have. The privileged context is written into the LAST user turn; system messages and earlier turns
are kept as they are, so student and teacher differ only in that one turn. The one exception is a
`system_prompt` context (context distillation: make a long system prompt permanent): it becomes
the system message, put before the student's own system message if there is one, so the teacher
sees exactly the prompt a deployment with that system prompt would send. Small models often
ignore their system message: `instructions` puts the same kind of standing instructions into the
last user turn instead. Measured on the default model (greedy, docs/distillation.md): "Start
every reply with 'Dear friend,'." as the system message was followed on 0 of 40 questions, after
the question in the user turn on 33 of 40, and never without it.

Templates follow the reference implementations, reworded for a small chat model:
- SDPO ("Reinforcement Learning via Self-Distillation", github.com/lasgroup/SDPO) builds
  `"{prompt}{solution}{feedback}\\n\\nCorrectly solve the original question."` from a successful
  sibling attempt and the feedback on a failed one; here both are `kind`s of one list, combined in
  the order given.
- SDFT ("Self-Distillation Enables Continual Learning") shows a demonstration, then asks for "a
  response of your own, including the thinking process"; we drop the thinking-process clause,
  which a small model without a reasoning format tends to follow literally, and end with a plain
  "Now answer the request.". Measured on the default model with the bundled knowledge facts (32
  questions, 4 teacher samples each at temperature 0.7; greedy / sampled accuracy / samples that
  talk about "the request", "the original" or "the example"): the reference wording 94 % / 64 % /
  31 %; the plain ending 97 % / 77 % / 22 %; the fact as a `fact` with the plain ending
  100 % / 81 % / 3 %. The student learns those words from the teacher, so they matter.
- A `fact` (background knowledge the answer needs, as in SDFT's knowledge-injection experiments)
  is shown as a fact, not as an example response.
- User follow-ups ("Aligning Language Models from User Interactions") are placed into the last user
  turn as hindsight ("the user's reaction to a previous answer: ...") rather than continuing the
  conversation with the student's answer and the follow-up: the teacher must score the student's
  tokens as an answer to the ORIGINAL request, so the request must stay the last user turn.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, fields
from typing import Any, Literal

from selfdistill.chat import Message, to_messages

KINDS = (
    "demonstration", "fact", "solution", "feedback", "ground_truth", "user_followup",
    "system_prompt", "instructions",
)
# Feedback kinds that environments report (see DESIGN.md); all are rendered as `feedback`.
FEEDBACK_ALIASES = ("test_failure", "runtime_error", "reviewer_note")


def _template_kind(kind: str) -> str:
    if kind in KINDS:
        return kind
    if kind in FEEDBACK_ALIASES:
        return "feedback"
    raise ValueError(
        f"unknown privileged context kind {kind!r}: allowed kinds are {', '.join(KINDS)} "
        f"(and {', '.join(FEEDBACK_ALIASES)}, rendered as feedback)"
    )


@dataclass(frozen=True)
class PrivilegedContext:
    """One piece of context the teacher sees and the student does not.

    `kind` is one of `KINDS` (or a `FEEDBACK_ALIASES` name); `text` is inserted verbatim.
    """

    kind: str
    text: str

    def __post_init__(self) -> None:
        _template_kind(self.kind)


@dataclass(frozen=True)
class ContextTemplates:
    """`str.format` templates for the teacher's last user turn; the field values are the defaults.

    Each kind's template renders one block from `{text}`; the blocks are concatenated in the order
    the contexts are given and the result fills `{context}` of `wrapper`, whose `{prompt}` is the
    original content of the last user turn. `system_prompt` blocks go to the system message
    instead (joined by a blank line), without the wrapper. Literal braces are written `{{ }}`.
    """

    demonstration: str = "\n\nThis is an example of a good response to the request:\n{text}"
    fact: str = "\n\nUseful fact: {text}"
    solution: str = "\n\nA correct solution:\n{text}"
    feedback: str = "\n\nThe following is feedback on an earlier, unsuccessful attempt:\n{text}"
    ground_truth: str = "\n\nThe correct answer is:\n{text}"
    user_followup: str = (
        "\n\n(The user's reaction to a previous answer: {text} Take it into account.)"
    )
    system_prompt: str = "{text}"  # the whole system message (see module docstring)
    instructions: str = "\n\nInstructions for your reply: {text}"
    wrapper: str = "{prompt}{context}\n\nNow answer the request."

    def __post_init__(self) -> None:
        for f in fields(self):
            wanted = {"prompt", "context"} if f.name == "wrapper" else {"text"}
            names = {
                name
                for _, name, _, _ in string.Formatter().parse(getattr(self, f.name))
                if name is not None
            }
            if names != wanted:
                raise ValueError(
                    f"template {f.name!r} must use exactly the placeholders "
                    f"{sorted(wanted)}, found {sorted(names)}"
                )


@dataclass
class TeacherPrompt:
    """The teacher's messages and how many context tokens truncation removed (0: none)."""

    messages: list[Message]
    truncated_tokens: int


def truncate_text(
    text: str, tokenizer: Any, max_tokens: int, side: Literal["left", "right"]
) -> tuple[str, int]:
    """Keep at most `max_tokens` tokens of `text`, cutting from `side`; returns (text, tokens cut).

    `side="left"` keeps the end (the last lines of a traceback), `"right"` keeps the beginning.
    Tokens are counted without special tokens; the kept ids are decoded back to text.
    """
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = len(ids) - max_tokens
    if cut <= 0:
        return text, 0
    kept = ids[cut:] if side == "left" else ids[:max_tokens]
    return tokenizer.decode(kept), cut


def build_teacher_messages(
    student_messages: str | list[Message],
    contexts: list[PrivilegedContext],
    *,
    templates: ContextTemplates | None = None,
    tokenizer: Any = None,
    max_context_tokens: int | None = None,
    truncate: Literal["left", "right"] = "left",
) -> TeacherPrompt:
    """The teacher's messages: `student_messages` with `contexts` written into the last user turn.

    `max_context_tokens` (None: no limit) caps each context's `text` separately, counted with
    `tokenizer` (required then) and cut on side `truncate`; template wording is never cut. With
    no contexts the teacher's messages equal the student's.
    """
    templates = templates or ContextTemplates()
    if truncate not in ("left", "right"):
        raise ValueError(f"truncate must be 'left' or 'right', got {truncate!r}")
    if max_context_tokens is not None:
        if max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1 or None, got {max_context_tokens}")
        if tokenizer is None:
            raise ValueError("max_context_tokens needs a tokenizer to count tokens")
    messages = to_messages(student_messages)
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
    if last_user is None:
        raise ValueError("student messages have no user turn to put the teacher context in")

    blocks, system, cut_total = [], [], 0
    for ctx in contexts:
        text = ctx.text
        if max_context_tokens is not None:
            text, cut = truncate_text(text, tokenizer, max_context_tokens, truncate)
            cut_total += cut
        kind = _template_kind(ctx.kind)
        (system if kind == "system_prompt" else blocks).append(
            getattr(templates, kind).format(text=text))
    if blocks:
        prompt = messages[last_user]["content"]
        content = templates.wrapper.format(prompt=prompt, context="".join(blocks))
        messages[last_user] = {**messages[last_user], "content": content}
    if system:
        messages = _with_system("\n\n".join(system), messages)
    return TeacherPrompt(messages=messages, truncated_tokens=cut_total)


def _with_system(text: str, messages: list[Message]) -> list[Message]:
    """`messages` with `text` as the system message, before any system message already there."""
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{text}\n\n{messages[0]['content']}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
