"""Style rules: checks on the form of a completion, for rows whose correctness is a format.

An evaluation row may carry `"rule": {...}` instead of (or besides) `"answer"`; the completion
follows the rule when every condition given holds. The completion is stripped of surrounding
whitespace first.

- `startswith`: the text begins with this string;
- `endswith`: the text ends with this string (a completion cut by the token budget fails it, so
  give the evaluation enough `max_new_tokens`);
- `regex`: `re.search` finds the pattern somewhere in the text;
- `upper: true`: the text has at least one letter and no lowercase letter ("ALL CAPS");
- `ignore_case: true`: `startswith` / `endswith` / `regex` ignore case (default false).

Context distillation (`examples/context_distillation.yaml`) uses a rule to measure whether a
system prompt's instruction survives once the system prompt is gone.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_STRINGS = ("startswith", "endswith", "regex")
_FLAGS = ("upper", "ignore_case")


@dataclass(frozen=True)
class Rule:
    """A conjunction of format conditions; None / False = that condition is not checked."""

    startswith: str | None = None
    endswith: str | None = None
    regex: str | None = None
    upper: bool = False
    ignore_case: bool = False


def parse_rule(obj: Any) -> Rule:
    """A `Rule` from a row's `rule` object; ValueError names the problem and the allowed keys."""
    allowed = ", ".join(_STRINGS + _FLAGS)
    if not isinstance(obj, dict) or not obj:
        raise ValueError(f"'rule' must be a non-empty object with keys among {allowed}, "
                         f"got {json.dumps(obj)[:60]}")
    unknown = sorted(set(obj) - set(_STRINGS + _FLAGS))
    if unknown:
        raise ValueError(f"'rule' has unknown key(s) {unknown}: allowed keys are {allowed}")
    for key in _STRINGS:
        if key in obj and (not isinstance(obj[key], str) or not obj[key]):
            raise ValueError(f"'rule'.{key} must be a non-empty string")
    for key in _FLAGS:
        if key in obj and not isinstance(obj[key], bool):
            raise ValueError(f"'rule'.{key} must be true or false")
    if not any(obj.get(k) for k in (*_STRINGS, "upper")):
        raise ValueError(f"'rule' checks nothing: give at least one of {allowed}")
    if "regex" in obj:
        try:
            re.compile(obj["regex"])
        except re.error as exc:
            raise ValueError(f"'rule'.regex is not a valid regular expression: {exc}") from None
    return Rule(**obj)


def follows_rule(text: str, rule: Rule) -> bool:
    """Whether `text` (stripped) meets every condition of `rule`."""
    text = text.strip()
    fold = (lambda s: s.casefold()) if rule.ignore_case else (lambda s: s)
    if rule.startswith is not None and not fold(text).startswith(fold(rule.startswith)):
        return False
    if rule.endswith is not None and not fold(text).endswith(fold(rule.endswith)):
        return False
    flags = re.IGNORECASE if rule.ignore_case else 0
    if rule.regex is not None and re.search(rule.regex, text, flags) is None:
        return False
    if rule.upper:
        letters = [c for c in text if c.isalpha()]
        if not letters or any(c.islower() for c in letters):
            return False
    return True
