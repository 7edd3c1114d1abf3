"""Governance of learning from users: consent (`selfdistill.serve.state` flags, default off),
PII redaction before storage (`redact`), per-tenant lesson rate limits (`admit_lesson`), and
deletion with proof (`deletion`). See docs/serving.md "Governance"."""

from selfdistill.governance.ratelimit import RateLimited, admit_lesson
from selfdistill.governance.redact import Redacted, redact, redact_messages

__all__ = ["RateLimited", "Redacted", "admit_lesson", "redact", "redact_messages"]
