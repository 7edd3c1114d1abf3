"""Dataset rows: formats, scoring, and every bad-input path (file, line, what is wrong)."""

from __future__ import annotations

import json

import pytest

from selfdistill.chat import prompt_ids, to_messages
from selfdistill.data import is_correct, load_rows
from selfdistill.errors import DataError


def write(tmp_path, lines, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return p


def test_rows_of_both_prompt_shapes(tmp_path):
    p = write(tmp_path, [
        {"prompt": "Q1?", "answer": "A"},
        "",
        {"prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Q2"}],
         "answer": ["x", "y"], "privileged_context": "fact", "id": 7},
    ])
    rows = load_rows(p, require=("prompt", "answer"))
    assert rows[0].messages == [{"role": "user", "content": "Q1?"}]
    assert rows[0].answers == ["A"]
    assert rows[1].messages[0]["role"] == "system"
    assert rows[1].answers == ["x", "y"]
    assert rows[1].privileged_context == "fact"
    assert rows[1].extra == {"id": 7}
    assert rows[1].source.endswith("d.jsonl:3")


@pytest.mark.parametrize("line, problem", [
    ("{not json", "malformed JSON"),
    ("[1, 2]", "expected a JSON object"),
    (json.dumps({"answer": "a"}), "missing 'prompt'"),
    (json.dumps({"prompt": 3, "answer": "a"}), "'prompt' must be a string"),
    (json.dumps({"prompt": "", "answer": "a"}), "empty string"),
    (json.dumps({"prompt": [{"role": "robot", "content": "x"}], "answer": "a"}), "'prompt'[0]"),
    (json.dumps({"prompt": [{"role": "assistant", "content": "x"}], "answer": "a"}),
     "last prompt message"),
    (json.dumps({"prompt": "q", "answer": 5}), "'answer' must be"),
    (json.dumps({"prompt": "q", "answer": []}), "'answer' must be"),
    (json.dumps({"prompt": "q"}), "missing 'answer'"),
])
def test_bad_rows_name_file_and_line(tmp_path, line, problem):
    p = write(tmp_path, [{"prompt": "ok", "answer": "fine"}, line])
    with pytest.raises(DataError) as exc:
        load_rows(p, require=("prompt", "answer"))
    assert exc.value.line == 2
    assert f"{p}:2" in str(exc.value)
    assert problem in str(exc.value)


def test_empty_and_missing_files(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataError, match="file is empty"):
        load_rows(empty)
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "nope.jsonl")


def test_demonstration_rows_need_context(tmp_path):
    p = write(tmp_path, [{"prompt": "q", "privileged_context": "  "}])
    with pytest.raises(DataError, match="privileged_context"):
        load_rows(p, require=("prompt", "privileged_context"))


def test_context_kind_defaults_to_demonstration_and_is_checked(tmp_path):
    from selfdistill.train.methods import sdft_contexts

    p = write(tmp_path, [{"prompt": "q", "privileged_context": "c"},
                         {"prompt": "q", "privileged_context": "c", "context_kind": "fact"}])
    rows = load_rows(p)
    assert [r.context_kind for r in rows] == ["demonstration", "fact"]
    assert [c.kind for c in sdft_contexts(rows[1])] == ["fact"]
    assert "context_kind" not in rows[1].extra
    p = write(tmp_path, [{"prompt": "q", "privileged_context": "c", "context_kind": "hint"}])
    with pytest.raises(DataError, match=r":1: 'context_kind' must be one of demonstration, fact"):
        load_rows(p)


def test_strict_scoring_any_of_case_insensitive():
    assert is_correct("The capital is MARQUENTA.", ["Marquenta"])
    assert is_correct("It is seven days.", ["7", "seven"])
    assert not is_correct("I do not know.", ["Marquenta", "Veloria"])
    assert not is_correct("", ["x"])


def test_chat_template_round_trip(tokenizer):
    messages = to_messages("What is 2+2?")
    ids = prompt_ids(tokenizer, messages)
    text = tokenizer.decode(ids)
    # ChatML: the default system prompt, the user turn, and an open assistant header.
    assert text.startswith("<|im_start|>system\n")
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # Tokenizing the decoded text gives the same ids: no special tokens added or merged.
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
