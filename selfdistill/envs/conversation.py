"""Conversation follow-ups: the user's next message is the privileged context.

A follow-up example is a triplet (messages, assistant response, next user message), as in
"Aligning Language Models from User Interactions" (Kleine Buening et al.): the student is the
model given `messages`; the teacher is the same model that has also seen the user's reply
("Get to the point...") to the logged response. Follow-ups carry no score, so reward is 0 and
`passed` False; whether the reply is a correction is for the teacher to judge in context.

JSONL formats, one object per line (both may be mixed in one file):
- triplet: `{"messages": [{"role", "content"}, ...], "response": str, "followup": str}`;
  `messages` ends with a user turn, `response` is the assistant's reply to it and `followup`
  the user's next message.
- chat log: `{"messages": [...]}` with no `followup`: every assistant turn that is followed by a
  user turn (and preceded by one) becomes one triplet.
Every problem is reported with file and line (DataError).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from selfdistill.chat import ROLES, Message, to_messages
from selfdistill.data import read_jsonl
from selfdistill.envs.base import Feedback


@dataclass(frozen=True)
class FollowupExample:
    """One (context, response, follow-up) triplet."""

    messages: list[Message]  # the context, ending with a user turn
    response: str  # the assistant's logged reply to it
    followup: str  # the user's next message
    source: str = ""  # "file:line" (plus "#turn" for chat logs)


class ConversationEnv:
    """One logged exchange; `step` returns the user's follow-up as feedback.

    The follow-up answers the *logged* response. Judging a freshly sampled completion with it
    is only sound when that completion is close to the logged one; `evidence["same_as_logged"]`
    says whether it is identical.
    """

    def __init__(self, example: FollowupExample) -> None:
        self.example = example
        self.messages = [dict(m) for m in example.messages]
        self.response = example.response

    def step(self, completion: str) -> Feedback:
        """The follow-up, verbatim, as privileged context (kind `user_followup`)."""
        evidence = {
            "response": self.response,
            "source": self.example.source,
            "same_as_logged": completion.strip() == self.response.strip(),
        }
        return Feedback(0.0, self.example.followup, "user_followup", False, evidence)


def example_from_triplet(obj: dict[str, Any], where: str = "") -> FollowupExample:
    """A triplet object → FollowupExample; ValueError names the problem."""
    messages = _messages(obj.get("messages", obj.get("prompt")))
    if messages[-1]["role"] != "user":
        raise ValueError("'messages' must end with a user turn (the one 'response' answers)")
    for key in ("response", "followup"):
        value = obj.get(key)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"'{key}' must be a non-empty string")
    return FollowupExample(messages, obj["response"], obj["followup"], where)


def examples_from_chat(messages: Any, where: str = "") -> list[FollowupExample]:
    """Every assistant turn preceded and followed by a user turn, as a triplet."""
    turns = _messages(messages)
    out = []
    for i in range(1, len(turns) - 1):
        if (
            turns[i]["role"] == "assistant"
            and turns[i - 1]["role"] == "user"
            and turns[i + 1]["role"] == "user"
        ):
            out.append(
                FollowupExample(
                    turns[:i], turns[i]["content"], turns[i + 1]["content"], f"{where}#{i}"
                )
            )
    return out


def load_followups(path: str | Path) -> list[FollowupExample]:
    """Read triplets and chat logs from a JSONL file (formats in the module docstring)."""
    from selfdistill.errors import DataError

    path = Path(path)
    out: list[FollowupExample] = []
    for lineno, obj in read_jsonl(path):
        where = f"{path}:{lineno}"
        try:
            if "followup" in obj or "response" in obj:
                out.append(example_from_triplet(obj, where))
            elif "messages" in obj:
                out.extend(examples_from_chat(obj["messages"], where))
            else:
                raise ValueError(
                    "expected 'messages' (a chat log) or 'messages', 'response' "
                    f"and 'followup' (a triplet); got keys {sorted(obj)}"
                )
        except ValueError as exc:
            raise DataError(path, lineno, str(exc)) from None
    if not out:
        raise DataError(path, None, "no follow-ups: no assistant turn is followed by a user turn")
    return out


def _messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise ValueError("'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(value):
        if not (
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
        ):
            raise ValueError(
                f"'messages'[{i}] must be {{'role': one of {ROLES}, "
                f"'content': str}}, got {json.dumps(m)[:80]}"
            )
    return to_messages(value)
