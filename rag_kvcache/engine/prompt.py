"""The fused prompt: `[system prefix][chunk 1][sep]...[chunk k][question]` as token ids.

The prompt is assembled from stored token ids, never by re-tokenising joined text, so the ids that
were cached at indexing time are exactly the ids in the prompt. The prefix and the question suffix
come from the model's chat template, split around a placeholder for the user's content.
`chat_segments` lays out a whole chat (the integrations' messages) the same way. Any other prompt is
tokenised whole (`render_prompt`), and the chunks found in it by their ids (the index's matching)
become cacheable runs of those chunks (`prefix_head`, `with_runs`).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

_PLACEHOLDER = "\x00RAGKV-USER-CONTENT\x00"
_CHUNK_MARK = re.compile("\x00RAGKV-CHUNK-([0-9]+)\x00")
_LITERAL_MARK = re.compile("\x01([0-9]+)\x02")  # delimiters apart from the chunk marks' NUL
_SEPARATOR = "\n\n"
_DOCUMENTS_HEAD = "Documents:\n"
_QUESTION_HEAD = "Question: "


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens; `cacheable` runs may come from the KV store, the others are always computed.

    A cacheable segment is a whole stored sequence (a chunk, the prefix), or a run of one: `ids` equal
    `whole[offset : offset + len(ids)]`, and its cache is that slice of `whole`'s cache.
    """

    ids: tuple[int, ...]
    cacheable: bool
    label: str = ""
    whole: tuple[int, ...] | None = None  # the stored sequence `ids` is a run of (None: `ids` itself)
    offset: int = 0  # where `ids` start in `whole`

    def __post_init__(self) -> None:
        if self.whole is not None and (
            not self.cacheable or self.whole[self.offset : self.offset + len(self.ids)] != self.ids
        ):
            raise ValueError(f"segment {self.label!r}: ids are not a cacheable run of `whole` at offset {self.offset}")

    @property
    def stored(self) -> tuple[int, ...]:
        """The stored sequence whose cache this segment reads."""
        return self.ids if self.whole is None else self.whole


@dataclass(frozen=True)
class PromptFormat:
    """Token-level template of the fused prompt for one tokenizer and system prompt."""

    prefix_ids: tuple[int, ...]
    separator_ids: tuple[int, ...]
    question_head: str
    question_tail: str

    @classmethod
    def build(cls, tokenizer, system_prompt: str) -> PromptFormat:
        if tokenizer.chat_template:
            messages = [
                {"role": "system", "content": system_prompt},
                {"role": "user", "content": _PLACEHOLDER},
            ]
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            head, tail = text.split(_PLACEHOLDER)
            head += _DOCUMENTS_HEAD
        else:  # a base model: plain text with the tokenizer's own BOS, if it adds one
            head = f"{tokenizer.bos_token or ''}{system_prompt}{_SEPARATOR}{_DOCUMENTS_HEAD}"
            tail = "\nAnswer:"
        prefix = tuple(tokenizer(head, add_special_tokens=False).input_ids)
        separator = tuple(tokenizer(_SEPARATOR, add_special_tokens=False).input_ids)
        return cls(prefix, separator, _SEPARATOR + _QUESTION_HEAD, tail)

    def question_ids(self, tokenizer, question: str) -> tuple[int, ...]:
        if not question.strip():
            raise ValueError("the question is empty")
        # The user's text is text: a "<|im_start|>system" in it is spelt out, never a control token
        # (split_special_tokens); only the template's own tail keeps its control tokens.
        text = tokenizer(f"{self.question_head}{question.strip()}", add_special_tokens=False, split_special_tokens=True)
        return tuple(text.input_ids) + tuple(tokenizer(self.question_tail, add_special_tokens=False).input_ids)

    def segments(self, chunks: list[tuple[int, ...]], question_ids: tuple[int, ...]) -> list[Segment]:
        """Prefix, chunks with separators between them, and the question."""
        out = [Segment(self.prefix_ids, cacheable=True, label="prefix")]
        for i, ids in enumerate(chunks):
            if i:
                out.append(Segment(self.separator_ids, cacheable=False, label="separator"))
            out.append(Segment(ids, cacheable=True, label=f"chunk{i}"))
        out.append(Segment(question_ids, cacheable=False, label="question"))
        return out


@dataclass(frozen=True)
class ChunkPart:
    """A retrieved chunk inside a chat message: its token ids as stored at indexing time."""

    ids: tuple[int, ...]
    label: str = ""


@dataclass(frozen=True)
class ChatTurn:
    """One chat message: a role (`system`, `user`, `assistant`, ...) and its text and chunk parts."""

    role: str
    parts: tuple[str | ChunkPart, ...]


def chat_segments(tokenizer, system_prompt: str, turns: Sequence[ChatTurn]) -> list[Segment]:
    """The segments of a chat prompt whose messages may carry retrieved chunks.

    Consecutive turns of one role are merged into one message. A conversation that does not open
    with a system turn gets `system_prompt` (the one the index's chunk caches were computed behind).
    Inside a message, parts are separated by a blank line, a run of chunks is introduced by
    "Documents:" and text right after chunks by "Question: ": the layout of `PromptFormat`, so one
    user turn of chunks and a question gives exactly `PromptFormat.segments`, and its chunks'
    caches are exact where a full prefill would compute the same. The chat template is rendered
    around the text; the chunks' stored ids are spliced in where they stand, never re-tokenised.
    A head equal to the system prefix is cacheable; all other text is computed at query time.
    """
    if not tokenizer.chat_template:
        raise ValueError(f"chat messages need a chat template; tokenizer {tokenizer.name_or_path!r} has none")
    merged: list[ChatTurn] = []
    for turn in turns:
        if merged and merged[-1].role == turn.role:
            merged[-1] = ChatTurn(turn.role, merged[-1].parts + turn.parts)
        else:
            merged.append(turn)
    if not merged:
        raise ValueError("no chat messages to answer")
    if merged[0].role != "system":
        merged.insert(0, ChatTurn("system", (system_prompt,)))
    chunks: list[ChunkPart] = []
    literals: list[str] = []
    messages = [
        {"role": turn.role, "content": _render_parts(turn.parts, chunks, tokenizer, literals)} for turn in merged
    ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    pieces = _CHUNK_MARK.split(text)  # text, chunk number, text, chunk number, ..., text
    order = [int(n) for n in pieces[1::2]]
    if order != list(range(len(chunks))):
        raise ValueError(f"the chat template of {tokenizer.name_or_path!r} reordered or dropped chunks: {order!r}")
    segments: list[Segment] = []
    for i, piece in enumerate(pieces[::2]):
        if i:
            segments.append(Segment(chunks[i - 1].ids, cacheable=True, label=chunks[i - 1].label))
        if piece:
            segments.append(Segment(tokenize_rendered(tokenizer, piece, literals), False, "text"))
    if segments[0].ids == PromptFormat.build(tokenizer, system_prompt).prefix_ids:
        segments[0] = replace(segments[0], cacheable=True, label="prefix")
    return segments


def render_prompt(tokenizer, system_prompt: str, prompt: str | Sequence[Mapping[str, str]]) -> tuple[int, ...]:
    """A prompt's token ids, the whole rendered text tokenised at once: a string is one user message
    and messages are taken as they are, both through the chat template (with `system_prompt` when
    they bring no system message); a tokenizer without a chat template takes a string as it is."""
    literals: list[str] = []
    if isinstance(prompt, str):
        if not tokenizer.chat_template:
            if not prompt.strip():
                raise ValueError("the prompt is empty")
            return tokenize_rendered(tokenizer, shield(tokenizer, prompt, literals), literals)
        prompt = [{"role": "user", "content": prompt}]
    if not tokenizer.chat_template:
        raise ValueError(f"chat messages need a chat template; tokenizer {tokenizer.name_or_path!r} has none")
    messages = [{"role": m["role"], "content": m["content"]} for m in prompt]
    if not messages or not any(m["content"].strip() for m in messages):
        raise ValueError(f"no text to answer in the messages {messages!r}")
    messages = [m | {"content": shield(tokenizer, m["content"], literals)} for m in messages]
    if messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenize_rendered(tokenizer, text, literals)


def shield(tokenizer, text: str, literals: list[str]) -> str:
    """`text`, which a user wrote, with each control-token string in it (`<|im_start|>`, ...) replaced by a
    numbered mark (the string appended to `literals`): rendered into a chat template and tokenised by
    `tokenize_rendered`, the template's own control tokens stay control tokens and the user's are spelt
    out as text, so that no message can open a turn of its own. Text without one is returned as it is."""

    def mark(match: re.Match) -> str:
        literals.append(match.group())
        return f"\x01{len(literals) - 1}\x02"

    return _control_tokens(tokenizer).sub(mark, text)


def tokenize_rendered(tokenizer, text: str, literals: Sequence[str]) -> tuple[int, ...]:
    """Token ids of text rendered around `shield`ed user text: control tokens live, but the `literals` the
    marks stand for tokenised as plain text (`split_special_tokens`). Text without marks is tokenised at
    once, as it would be without any of this."""
    pieces = _LITERAL_MARK.split(text)  # text, literal number, text, ...
    ids: list[int] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            ids += tokenizer(literals[int(piece)], add_special_tokens=False, split_special_tokens=True).input_ids
        elif piece:
            ids += tokenizer(piece, add_special_tokens=False).input_ids
    return tuple(ids)


@functools.lru_cache(maxsize=8)
def _control_tokens(tokenizer) -> re.Pattern:
    """A pattern matching the tokenizer's control-token strings (its special added tokens), longest first,
    and the characters this module's marks are made of (NUL, SOH, STX: a user's text then holds no mark)."""
    specials = sorted({t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, [*specials, "\x00", "\x01", "\x02"])))


@dataclass(frozen=True)
class StoredRun:
    """Prompt tokens [start, start + length) equal `whole[offset : offset + length]`, a stored sequence."""

    start: int
    whole: tuple[int, ...]
    offset: int
    length: int
    label: str = ""


def prefix_head(ids: Sequence[int], prefix_ids: Sequence[int]) -> list[Segment]:
    """A prompt as one computed segment, but for its head where it agrees with the system prefix: a
    cacheable run of the prefix (exact: the prefix's cache is computed from position 0)."""
    ids = tuple(ids)
    head = next((i for i, (a, b) in enumerate(zip(ids, prefix_ids)) if a != b), min(len(ids), len(prefix_ids)))
    head = min(head, len(ids) - 1)  # the last token is always computed
    text = Segment(ids[head:], False, "text")
    return [Segment(ids[:head], True, "prefix", tuple(prefix_ids), 0), text] if head else [text]


def with_runs(segments: Sequence[Segment], runs: Sequence[StoredRun]) -> list[Segment]:
    """`segments` with the stored `runs` found in the prompt (positions in the whole prompt, in order,
    not overlapping) made cacheable runs of their sequences wherever they fall inside computed
    segments; the rest of those stays computed. Runs are trimmed to start after position 0 (which
    only the prefix's cache serves) and to end before the prompt's last token (always computed)."""
    n = sum(len(seg.ids) for seg in segments)
    out: list[Segment] = []
    start = 0
    for seg in segments:
        end = start + len(seg.ids)
        if seg.cacheable:
            out.append(seg)
            start = end
            continue
        at = start
        for run in runs:
            lo, hi = max(run.start, at, 1), min(run.start + run.length, end, n - 1)
            if hi <= lo:
                continue
            if lo > at:
                out.append(Segment(seg.ids[at - start : lo - start], False, seg.label))
            offset = run.offset + lo - run.start
            out.append(Segment(seg.ids[lo - start : hi - start], True, run.label, run.whole, offset))
            at = hi
        if at < end:
            out.append(Segment(seg.ids[at - start :], False, seg.label))
        start = end
    return out


def _render_parts(parts: Sequence[str | ChunkPart], chunks: list[ChunkPart], tokenizer, literals: list[str]) -> str:
    """A message's content with a numbered mark where each chunk goes (appended to `chunks`), its text
    `shield`ed (control-token strings in it marked, appended to `literals`)."""
    out: list[str] = []
    after_chunk = False
    for part in parts:
        if isinstance(part, ChunkPart):
            out.append(("" if after_chunk else _DOCUMENTS_HEAD) + f"\x00RAGKV-CHUNK-{len(chunks)}\x00")
            chunks.append(part)
            after_chunk = True
        elif part:
            out.append((_QUESTION_HEAD if after_chunk else "") + shield(tokenizer, part, literals))
            after_chunk = False
    return _SEPARATOR.join(out)
