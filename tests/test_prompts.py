"""Uploaded prompts and length limits: every bad input gets a message that says what to do."""

import pytest

from kvviz.comparison.prompts import LengthCheck, decode_upload, prompt_limit, truncate_middle
from kvviz.comparison.session import PromptError


def test_good_upload_is_decoded_with_or_without_bom():
    assert decode_upload("notes.md", "# Héllo".encode(), 1000) == "# Héllo"
    assert decode_upload("a.txt", b"\xef\xbb\xbfhi", 1000) == "hi"


@pytest.mark.parametrize("name, data, message", [
    ("a.pdf", b"text", "not a .txt or .md file"),
    ("a.txt", b"x" * 2001, "the limit is"),
    ("a.txt", b"PK\x03\x04\x00\x00", "looks binary"),
    ("a.txt", "café".encode("latin-1"), "not UTF-8"),
    ("a.txt", b"  \n", "is empty"),
])
def test_bad_uploads_are_refused_with_a_reason(name, data, message):
    with pytest.raises(PromptError, match=message):
        decode_upload(name, data, 2000)


def test_length_limit_leaves_room_for_generation():
    assert prompt_limit(8192, 4096, 256) == 4096
    assert prompt_limit(2048, 4096, 256) == 1792
    check = LengthCheck(tokens=5000, limit=4096)
    assert check.too_long and "5,000 tokens" in check.message and "Cut it in the middle" in check.message


def test_truncation_cuts_the_middle_and_keeps_the_question_and_the_template_end(real_model):
    tokenizer = real_model.tokenizer
    document = "Once upon a time there was a lighthouse. " + "The waves rolled in and out. " * 300 + \
        "\n\nQuestion: what stood on the cliff?"
    cut = truncate_middle(tokenizer, document, chat=True, limit=200)
    text = tokenizer.decode(cut.token_ids)
    assert len(cut.token_ids) <= 200
    assert "Once upon a time there was a lighthouse." in text, "the start survives"
    assert text.rstrip().endswith("what stood on the cliff?<|im_end|>\n<|im_start|>assistant"), "question + template"
    assert cut.kept_start + cut.kept_end < cut.document_tokens
    assert f"last {cut.kept_end:,} tokens" in cut.message and "from the middle" in cut.message
