"""PII redaction with documented patterns, applied before anything is stored or trained on.

Each kind is a regular expression plus, where one exists, a checksum that keeps false positives
down; a match is replaced by ``[KIND]`` and counted. Kinds, in the order they are applied:

| kind | pattern | check |
|---|---|---|
| EMAIL | local@domain.tld (RFC 5322 "dot-atom" subset) | — |
| IBAN | 2 letters, 2 check digits, 11–30 alphanumerics (spaces allowed) | ISO 13616 mod 97 |
| CARD | 13–19 digits, optionally grouped by spaces or dashes | Luhn |
| IP | IPv4 dotted quad, or IPv6 (full or `::`-compressed hex groups) | octet ≤ 255; parses |
| PHONE | optional +country code, 7–15 digits with spaces, dots, dashes, parentheses | ≥ 7 digits |

Names are not detected: Microsoft Presidio would find PERSON entities, but only through a spaCy
NER model that is downloaded separately (not a PyPI dependency), which this project cannot do
offline; see docs/serving.md "Privacy".
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}")
IBAN = re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}\b")
CARD = re.compile(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])")
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
IPV6 = re.compile(r"(?<![\w:])(?:[0-9A-Fa-f]{0,4}:){2,7}[0-9A-Fa-f]{0,4}(?![\w:])")
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{1,4}\)[ .-]?)?\d(?:[ .-]?\d){6,13}(?!\w)"
)


def luhn_ok(digits: str) -> bool:
    """The Luhn checksum of a digit string (card numbers): Σ of digits, every second one from
    the right doubled (minus 9 above 9), ≡ 0 mod 10."""
    total = 0
    for i, ch in enumerate(reversed(digits)):
        d = int(ch)
        if i % 2 == 1:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def iban_ok(iban: str) -> bool:
    """ISO 13616: move the first four characters to the end, letters → 10..35, the number
    mod 97 must be 1."""
    s = iban.replace(" ", "").upper()
    if not 15 <= len(s) <= 34:
        return False
    moved = s[4:] + s[:4]
    return int("".join(str(int(c, 36)) for c in moved)) % 97 == 1


def _ipv4_ok(s: str) -> bool:
    return all(int(p) <= 255 for p in s.split("."))


def _ipv6_ok(s: str) -> bool:
    try:
        ipaddress.IPv6Address(s)
    except ValueError:
        return False
    return True


def _digits(s: str) -> str:
    return re.sub(r"\D", "", s)


@dataclass(frozen=True)
class _Kind:
    name: str
    pattern: re.Pattern[str]
    valid: Callable[[str], bool] = field(default=lambda _: True)


KINDS = (
    _Kind("EMAIL", EMAIL),
    _Kind("IBAN", IBAN, iban_ok),
    _Kind("CARD", CARD, lambda m: luhn_ok(_digits(m))),
    _Kind("IP", IPV4, _ipv4_ok),
    _Kind("IP", IPV6, _ipv6_ok),
    _Kind("PHONE", PHONE, lambda m: 7 <= len(_digits(m)) <= 15),
)


@dataclass
class Redacted:
    """The redacted text and how many matches of each kind were replaced."""

    text: str
    counts: dict[str, int]


def redact(text: str) -> Redacted:
    """Replace every match of `KINDS` (that passes its check) by ``[KIND]``."""
    counts: Counter[str] = Counter()
    for kind in KINDS:

        def sub(m: re.Match[str], kind: _Kind = kind) -> str:
            if not kind.valid(m.group(0)):
                return m.group(0)
            counts[kind.name] += 1
            return f"[{kind.name}]"

        text = kind.pattern.sub(sub, text)
    return Redacted(text, dict(counts))


def redact_messages(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], Counter[str]]:
    """Each message's content redacted, and the counts over all of them."""
    total: Counter[str] = Counter()
    out = []
    for m in messages:
        r = redact(m["content"])
        total.update(r.counts)
        out.append({**m, "content": r.text})
    return out, total
