"""Context distillation: the `system_prompt` teacher context, `rule` checks in evaluation rows,
and the bundled example (its data and config load; the slow test trains it briefly)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from selfdistill.data import load_rows, row_correct
from selfdistill.errors import DataError
from selfdistill.rules import Rule, follows_rule, parse_rule
from selfdistill.teacher import PrivilegedContext, build_teacher_messages

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_system_prompt_becomes_the_teachers_system_message():
    sp = PrivilegedContext("system_prompt", "Always start with 'Ahoy!'.")
    bare = build_teacher_messages("Why is the sky blue?", [sp]).messages
    assert bare == [{"role": "system", "content": "Always start with 'Ahoy!'."},
                    {"role": "user", "content": "Why is the sky blue?"}]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    both = build_teacher_messages(chat, [sp, PrivilegedContext("fact", "F.")]).messages
    assert both[0] == {"role": "system", "content": "Always start with 'Ahoy!'.\n\nBe brief."}
    assert both[1]["content"] == "Hi\n\nUseful fact: F.\n\nNow answer the request."
    assert chat[0]["content"] == "Be brief."  # the student's messages are not modified


@pytest.mark.parametrize("rule, text, ok", [
    ({"startswith": "Ahoy"}, "  Ahoy! The sky is blue.", True),
    ({"startswith": "Ahoy"}, "ahoy! The sky is blue.", False),
    ({"startswith": "Ahoy", "ignore_case": True}, "ahoy! The sky", True),
    ({"endswith": "Over."}, "It is blue. Over.\n", True),
    ({"endswith": "Over."}, "It is blue. Over and out.", False),
    ({"regex": r"\bblue\b"}, "It is blue.", True),
    ({"regex": r"\bblue\b"}, "It is bluish.", False),
    ({"upper": True}, "IT IS BLUE, 42!", True),
    ({"upper": True}, "IT IS Blue", False),
    ({"upper": True}, "42 !", False),
    ({"startswith": "A", "endswith": "."}, "A b.", True),
    ({"startswith": "A", "endswith": "."}, "A b", False),
])
def test_follows_rule(rule, text, ok):
    assert follows_rule(text, parse_rule(rule)) is ok


@pytest.mark.parametrize("rule, needle", [
    ({}, "non-empty object"),
    ({"startswith": 3}, "startswith must be a non-empty string"),
    ({"upper": "yes"}, "upper must be true or false"),
    ({"ignore_case": True}, "checks nothing"),
    ({"regex": "("}, "not a valid regular expression"),
    ({"prefix": "A"}, "unknown key"),
])
def test_bad_rules_are_data_errors_with_file_and_line(tmp_path, rule, needle):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"prompt": "Q?", "answer": "x"}) + "\n"
                    + json.dumps({"prompt": "Q?", "rule": rule}) + "\n")
    with pytest.raises(DataError, match=f"eval.jsonl:2: .*{needle}"):
        load_rows(path, require=("prompt", "answer"))


def test_a_rule_can_replace_the_answer_and_both_must_hold(tmp_path):
    path = tmp_path / "eval.jsonl"
    path.write_text(json.dumps({"prompt": "Q?", "rule": {"startswith": "Ahoy"}}) + "\n"
                    + json.dumps({"prompt": "Q?", "rule": {"startswith": "Ahoy"},
                                  "answer": "Paris"}) + "\n")
    rule_only, both = load_rows(path, require=("prompt", "answer"))
    assert rule_only.rule == Rule(startswith="Ahoy") and "rule" not in rule_only.extra
    assert row_correct(rule_only, "Ahoy! Anything.") and not row_correct(rule_only, "Paris.")
    assert row_correct(both, "Ahoy, Paris.")
    assert not row_correct(both, "Ahoy, Rome.") and not row_correct(both, "Paris.")


def test_instructions_go_into_the_user_turn():
    ctx = PrivilegedContext("instructions", "Begin with 'Dear friend,'.")
    msgs = build_teacher_messages("Why is the sky blue?", [ctx]).messages
    assert msgs == [{"role": "user", "content": "Why is the sky blue?\n\nInstructions for your "
                     "reply: Begin with 'Dear friend,'.\n\nNow answer the request."}]


def test_the_bundled_example_loads_and_every_row_is_checked_by_its_rule():
    from selfdistill.train import load_config
    from selfdistill.train.run import load_datasets

    cfg = load_config(EXAMPLES / "context_distillation.yaml")
    rows, suites, _ = load_datasets(cfg)
    assert set(suites) == {"train", "heldout", "probes"} and len(suites["train"]) == len(rows)
    train_prompts = {r.messages[-1]["content"] for r in rows}
    for row in rows + suites["heldout"]:
        assert row.context_kind == "instructions" and row.rule is not None
        assert row_correct(row, "Dear friend, the sky is blue.")
        assert not row_correct(row, "The sky is blue.")
    assert not train_prompts & {r.messages[-1]["content"] for r in suites["heldout"]}
