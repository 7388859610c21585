"""Uploaded prompts and length limits: every bad input gets a message that says what to do."""

import pytest

from kvviz.prompts import LengthCheck, decode_upload, prompt_limit, truncate_keep_start
from kvviz.session import PromptError


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
    assert check.too_long and "5,000 tokens" in check.message and "Truncate" in check.message
    assert truncate_keep_start(list(range(10)), 4) == [0, 1, 2, 3]
