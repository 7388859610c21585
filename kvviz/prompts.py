"""Checking what users hand in: uploaded files and prompt lengths, with messages that say what to do."""

from __future__ import annotations

from dataclasses import dataclass

from kvviz.session import PromptError

TEXT_SUFFIXES = (".txt", ".md")


def decode_upload(name: str, data: bytes, max_bytes: int) -> str:
    """The text of an uploaded prompt file, or PromptError for empty, oversized, binary or non-UTF-8 files.

    The file's name is only inspected, never used as a path.
    """
    if not name.lower().endswith(TEXT_SUFFIXES):
        raise PromptError(f"'{name}' is not a .txt or .md file")
    if len(data) > max_bytes:
        raise PromptError(f"'{name}' is {len(data) / 2**20:.1f} MB; the limit is {max_bytes / 2**20:.1f} MB")
    if b"\x00" in data:
        raise PromptError(f"'{name}' looks binary (it contains NUL bytes); upload plain text")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise PromptError(f"'{name}' is not UTF-8 text (byte {error.start} cannot be decoded); save it as UTF-8") \
            from None
    if not text.strip():
        raise PromptError(f"'{name}' is empty")
    return text


@dataclass
class LengthCheck:
    """How a prompt's length compares with what this server allows."""

    tokens: int
    limit: int

    @property
    def too_long(self) -> bool:
        return self.tokens > self.limit

    @property
    def message(self) -> str:
        return (f"The prompt has {self.tokens:,} tokens; this server allows {self.limit:,}. "
                "Truncate it to the first part, or shorten it.")


def prompt_limit(context_length: int, max_prompt_tokens: int, max_new_tokens: int) -> int:
    """Largest prompt that still leaves room for generation inside the model's context and the server's cap."""
    room = context_length - max_new_tokens if context_length else max_prompt_tokens
    return max(1, min(max_prompt_tokens, room))


def truncate_keep_start(token_ids: list[int], limit: int) -> list[int]:
    """Keep the first ``limit`` tokens (the start holds the sink tokens and, for chat, the template)."""
    return token_ids[:limit]
