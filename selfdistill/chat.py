"""Chat messages and their token ids under a model's chat template."""

from __future__ import annotations

from typing import Any

Message = dict[str, str]  # {"role": "system" | "user" | "assistant", "content": str}
ROLES = ("system", "user", "assistant")


def to_messages(prompt: str | list[Message]) -> list[Message]:
    """A plain-string prompt is a single user message; a list is taken as chat messages."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return [dict(m) for m in prompt]


def prompt_ids(tokenizer: Any, messages: list[Message]) -> list[int]:
    """Token ids of `messages` followed by the template's assistant header (generation prompt).

    Rendered to text first and tokenized without extra special tokens, so the ids are exactly
    what the template says and student/teacher prompts tokenize the same way.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
