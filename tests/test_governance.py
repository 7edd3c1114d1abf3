"""PII redaction patterns and their checksums (pure functions, no model)."""

from __future__ import annotations

import pytest

from selfdistill.governance.redact import iban_ok, luhn_ok, redact, redact_messages


@pytest.mark.parametrize(("text", "want", "counts"), [
    ("write to john.doe+x@example.co.uk today", "write to [EMAIL] today", {"EMAIL": 1}),
    ("card 4111 1111 1111 1111.", "card [CARD].", {"CARD": 1}),
    ("card 4111-1111-1111-1111", "card [CARD]", {"CARD": 1}),
    ("IBAN DE89 3704 0044 0532 0130 00 please", "IBAN [IBAN] please", {"IBAN": 1}),
    ("GB82WEST12345698765432", "[IBAN]", {"IBAN": 1}),
    ("from 192.168.0.1 and 2001:db8::8a2e:370:7334", "from [IP] and [IP]", {"IP": 2}),
    ("call +1 (555) 123-4567 or 020 7946 0958", "call [PHONE] or [PHONE]", {"PHONE": 2}),
    ("The capital of France is Paris.", "The capital of France is Paris.", {}),
    ("in 2024 at 12:30, pi is 3.14159", "in 2024 at 12:30, pi is 3.14159", {}),
    ("999.1.1.1 is no address", "999.1.1.1 is no address", {}),
])
def test_redaction(text, want, counts):
    r = redact(text)
    assert (r.text, r.counts) == (want, counts)


def test_checksums_and_messages():
    assert luhn_ok("4111111111111111") and not luhn_ok("4111111111111112")
    assert iban_ok("DE89 3704 0044 0532 0130 00") and not iban_ok("DE88 3704 0044 0532 0130 00")
    msgs, counts = redact_messages([{"role": "user", "content": "a@b.io"},
                                    {"role": "assistant", "content": "ok, a@b.io"}])
    assert [m["content"] for m in msgs] == ["[EMAIL]", "ok, [EMAIL]"] and counts == {"EMAIL": 2}
    assert msgs[0]["role"] == "user"
