"""The fused prompt: `[system prefix][chunk 1][sep]...[chunk k][question]` as token ids.

The prompt is assembled from stored token ids, never by re-tokenising joined text, so the ids that
were cached at indexing time are exactly the ids in the prompt. The prefix and the question suffix
come from the model's chat template, split around a placeholder for the user's content.
"""

from __future__ import annotations

from dataclasses import dataclass

_PLACEHOLDER = "\x00RAGKV-USER-CONTENT\x00"
_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Segment:
    """A run of prompt tokens; `cacheable` runs may come from the KV store, the others are always computed."""

    ids: tuple[int, ...]
    cacheable: bool
    label: str = ""


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
            head += "Documents:\n"
        else:  # a base model: plain text with the tokenizer's own BOS, if it adds one
            head = f"{tokenizer.bos_token or ''}{system_prompt}\n\nDocuments:\n"
            tail = "\nAnswer:"
        prefix = tuple(tokenizer(head, add_special_tokens=False).input_ids)
        separator = tuple(tokenizer(_SEPARATOR, add_special_tokens=False).input_ids)
        return cls(prefix, separator, _SEPARATOR + "Question: ", tail)

    def question_ids(self, tokenizer, question: str) -> tuple[int, ...]:
        if not question.strip():
            raise ValueError("the question is empty")
        text = f"{self.question_head}{question.strip()}{self.question_tail}"
        return tuple(tokenizer(text, add_special_tokens=False).input_ids)

    def segments(self, chunks: list[tuple[int, ...]], question_ids: tuple[int, ...]) -> list[Segment]:
        """Prefix, chunks with separators between them, and the question."""
        out = [Segment(self.prefix_ids, cacheable=True, label="prefix")]
        for i, ids in enumerate(chunks):
            if i:
                out.append(Segment(self.separator_ids, cacheable=False, label="separator"))
            out.append(Segment(ids, cacheable=True, label=f"chunk{i}"))
        out.append(Segment(question_ids, cacheable=False, label="question"))
        return out
