"""Checking what users hand in: uploaded files and prompt lengths, with messages that say what to do."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvviz.comparison.session import PromptError, encode_prompt

TEXT_SUFFIXES = (".txt", ".md")
PROMPT_SET_SUFFIX = ".jsonl"


def decode_upload(name: str, data: bytes, max_bytes: int, suffixes: tuple[str, ...] = TEXT_SUFFIXES) -> str:
    """The text of an uploaded prompt file, or PromptError for empty, oversized, binary or non-UTF-8 files.

    The file's name is only inspected, never used as a path.
    """
    if not name.lower().endswith(suffixes):
        raise PromptError(f"'{name}' is not a {' or '.join(suffixes)} file")
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
                "Cut it in the middle (its start and end, with the question, are kept), or shorten it.")


def prompt_limit(context_length: int, max_prompt_tokens: int, max_new_tokens: int) -> int:
    """Largest prompt that still leaves room for generation inside the model's context and the server's cap."""
    room = context_length - max_new_tokens if context_length else max_prompt_tokens
    return max(1, min(max_prompt_tokens, room))


CUT_MARK = "\n[…]\n"


@dataclass
class Truncation:
    """A document cut in its middle so that it fits: its start and end survive, and so do the chat template's
    closing tokens and a question at the end."""

    token_ids: list[int]  # the prompt to run, template included
    document_tokens: int  # the document's own tokens before the cut
    kept_start: int  # document tokens kept from the start
    kept_end: int  # document tokens kept from the end

    @property
    def message(self) -> str:
        cut = self.document_tokens - self.kept_start - self.kept_end
        return (f"Cut {cut:,} tokens from the middle of the document (its tokens {self.kept_start + 1:,}–"
                f"{self.kept_start + cut:,} of {self.document_tokens:,}); kept its first {self.kept_start:,} and "
                f"last {self.kept_end:,} tokens, so the question at the end survives. "
                f"The prompt now has {len(self.token_ids):,} tokens.")


def truncate_middle(tokenizer, text: str, chat: bool, limit: int) -> Truncation:
    """Cut ``text`` in the middle before the chat template is applied, so the prompt fits in ``limit`` tokens.

    Keeping the start preserves the attention sinks and the document's setting; keeping the end preserves the
    question and the template's end (otherwise the model continues the document instead of answering).
    """
    document = tokenizer(text, add_special_tokens=False)["input_ids"]
    overhead = len(encode_prompt(tokenizer, text, chat)) - len(document)
    room = limit - overhead - len(tokenizer(CUT_MARK, add_special_tokens=False)["input_ids"])
    while room > 1:
        start, end = (room + 1) // 2, room // 2
        cut_text = tokenizer.decode(document[:start]) + CUT_MARK + tokenizer.decode(document[len(document) - end:])
        ids = encode_prompt(tokenizer, cut_text, chat)
        if len(ids) <= limit:
            return Truncation(ids, len(document), start, end)
        room -= max(1, len(ids) - limit)  # re-tokenizing across the cut may add a token or two
    raise PromptError(f"the limit of {limit} tokens leaves no room for the document")


@dataclass(frozen=True)
class PromptLine:
    """One prompt of a prompt set: where it came from (a file, or a line of a .jsonl file), its text, the answer
    a correct output contains (None: the set is scored by agreement with full) and the group of prompts sharing its
    document (None: its own), which intervals resample as one."""

    name: str
    text: str
    answer: str | None = None
    group: str | None = None


def parse_prompt_lines(name: str, text: str) -> list[PromptLine]:
    """The prompts of a .jsonl file, one ``{"prompt": ..., "answer": ..., "group": ...}`` object per line (``answer``
    and ``group`` optional, blank lines skipped); PromptError naming the file and line of the first bad one."""
    lines = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"'{name}' line {number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise PromptError(f"{where} is not JSON ({error.msg} at column {error.colno})") from None
        if not isinstance(record, dict) or "prompt" not in record:
            raise PromptError(f'{where} has no "prompt": each line is {{"prompt": "...", "answer": "..."}}')
        prompt, answer = record["prompt"], record.get("answer")
        if not isinstance(prompt, str) or not prompt.strip():
            raise PromptError(f'{where}: "prompt" must be non-empty text')
        if answer is not None and (not isinstance(answer, (str, int, float)) or not str(answer).strip()):
            raise PromptError(f'{where}: "answer" must be non-empty text or a number')
        group = record.get("group")
        if group is not None and (not isinstance(group, (str, int)) or not str(group).strip()):
            raise PromptError(f'{where}: "group" must be non-empty text or a number')
        lines.append(PromptLine(f"{name}:{number}", prompt, None if answer is None else str(answer).strip(),
                                None if group is None else str(group).strip()))
    if not lines:
        raise PromptError(f"'{name}' holds no prompt")
    return lines


def read_prompt_set(files: list[tuple[str, bytes]], max_bytes: int) -> list[PromptLine]:
    """A prompt set from files as uploaded (name, bytes): each .jsonl file gives its lines, each .txt or .md file
    one prompt without an answer. PromptError naming the file (and line) at fault, or when some prompts carry an
    answer and others do not (accuracy and agreement cannot be mixed in one point)."""
    if not files:
        raise PromptError("give at least one prompt file")
    prompts: list[PromptLine] = []
    for name, data in files:
        if name.lower().endswith(PROMPT_SET_SUFFIX):
            prompts += parse_prompt_lines(name, decode_upload(name, data, max_bytes, (PROMPT_SET_SUFFIX,)))
        else:
            prompts.append(PromptLine(name, decode_upload(name, data, max_bytes)))
    answered = [p for p in prompts if p.answer is not None]
    if answered and len(answered) < len(prompts):
        missing = next(p for p in prompts if p.answer is None)
        raise PromptError(f"{missing.name} has no answer while {answered[0].name} has one: give every prompt an "
                          "answer (scored by accuracy) or none (scored by agreement with full)")
    return prompts
