"""Decoding that continues from a fused prompt cache: greedy or sampled, stop strings, streaming,
optionally constrained to a JSON Schema; and teacher forcing, which scores a given answer from such a cache."""

from __future__ import annotations

import functools
import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import torch

from ..config import GenerationConfig
from .model import ModelAdapter

if TYPE_CHECKING:
    import llguidance
    from transformers import PreTrainedTokenizerBase


def sample_token(
    logits: torch.Tensor, cfg: GenerationConfig, rng: torch.Generator | None, allowed: torch.Tensor | None = None
) -> int:
    """Greedy argmax at temperature 0, else temperature + nucleus (top-p) sampling, of next-token logits [V],
    among the `allowed` tokens (bool [V]) when given."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))  # [V]
    if cfg.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)  # [V]
    sorted_p, order = probs.sort(descending=True)  # [V]
    keep = sorted_p.cumsum(0) - sorted_p < cfg.top_p  # [V], always keeps the top token
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=rng)  # [1]
    return int(order[choice])


class JsonSchemaConstraint:
    """Keeps an answer inside a JSON Schema (grammar-constrained decoding with llguidance): before each
    token, only the tokens that can continue a document matching the schema may be chosen; once the
    document is complete, only end of sequence. Compact JSON (no free whitespace between tokens), and
    strict as OpenAI's structured outputs are: an object schema with `properties` that does not say
    `additionalProperties` gets none (else any key of any length may follow the listed ones)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, eos_token_ids: Collection[int], schema: str) -> None:
        try:
            import llguidance
        except ImportError as e:
            raise ImportError("answers constrained to a JSON Schema need llguidance: pip install 'rag-kvcache[structured]'") from e
        try:
            document = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"json_schema is not JSON: {e}: {schema[:200]!r}") from e
        grammar = llguidance.LLMatcher.grammar_from_json_schema(_closed(document), defaults={"whitespace_flexible": False})
        self.matcher = llguidance.LLMatcher(_guidance_tokenizer(tokenizer, tuple(sorted(eos_token_ids))), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"cannot constrain decoding to JSON Schema {schema[:200]!r}: {self.matcher.get_error()}")

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """The tokens that may come next, bool [vocab_size] (ids the tokenizer does not know are never allowed)."""
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(n / 32)]
        bits = ((words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten().bool()  # [32 * ceil(n / 32)]
        allowed = torch.zeros(vocab_size, dtype=torch.bool)  # [V]
        n = min(vocab_size, bits.numel())
        allowed[:n] = bits[:n]
        return allowed

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise ValueError(f"token {token} does not continue the JSON Schema's grammar: {self.matcher.get_error()}")


def _closed(schema: object) -> object:
    """`schema` with `"additionalProperties": false` in every object schema that lists `properties` and
    says nothing about other keys (nested ones, `$defs`, `items`, `anyOf`, ... included)."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in closed and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


@functools.lru_cache(maxsize=8)
def _guidance_tokenizer(tokenizer: PreTrainedTokenizerBase, eos_token_ids: tuple[int, ...]) -> llguidance.LLTokenizer:
    """llguidance's view of a fast Hugging Face tokenizer (built in ~0.4 s, so kept per tokenizer)."""
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, eos_token=list(eos_token_ids))
    except ValueError as e:  # e.g. a WordPiece tokenizer, whose decoder puts spaces between tokens
        raise ValueError(
            f"answers constrained to a JSON Schema need a byte-level or SentencePiece-style fast tokenizer; "
            f"{type(tokenizer).__name__} of {tokenizer.name_or_path!r} is not one: {e}"
        ) from e


@dataclass(frozen=True)
class Step:
    """One generated token and the new text it releases (empty while held back); a final step with
    `token_id=None` flushes text held back because it might have begun a stop string."""

    token_id: int | None
    text: str


class Decoder:
    """Generates from a prompt cache: the first token from the fused logits, the rest step by step;
    every token constrained to `cfg.json_schema` when it names one."""

    def __init__(self, adapter: ModelAdapter, cfg: GenerationConfig) -> None:
        self.adapter = adapter
        self.cfg = cfg
        self.constraint = None
        if cfg.json_schema is not None:
            self.constraint = JsonSchemaConstraint(adapter.tokenizer, adapter.eos_token_ids, cfg.json_schema)
        self.rng = None
        if cfg.temperature > 0:
            self.rng = torch.Generator(device=adapter.device)
            if cfg.seed is not None:
                self.rng.manual_seed(cfg.seed)
            else:
                self.rng.seed()

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from next-token logits [V], by the sampling rule, among those the constraint allows."""
        allowed = None if self.constraint is None else self.constraint.allowed(logits.shape[-1])  # [V]
        return sample_token(logits, self.cfg, self.rng, allowed)

    def steps(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], first_logits: torch.Tensor, first_token: int
    ) -> Iterator[Step]:
        """Yield decoded steps, `first_token` (already sampled from `first_logits`, by `sample` when
        constrained) included.

        Stops at an end-of-sequence token, a stop string (its text is cut), or `max_new_tokens`.
        """
        eos = self.adapter.eos_token_ids
        cache = self.adapter.make_cache(keys, values, room=self.cfg.max_new_tokens)
        position = keys[0].shape[-2]
        hold = max((len(s) - 1 for s in self.cfg.stop), default=0)  # chars that may start a stop string
        ids: list[int] = []
        text = emitted = ""
        token = first_token
        while token not in eos:
            if self.constraint is not None:
                self.constraint.advance(token)
            ids.append(token)
            text = self.adapter.tokenizer.decode(ids, skip_special_tokens=True)
            cut = min((i for i in (text.find(s) for s in self.cfg.stop) if i >= 0), default=-1)
            if cut >= 0:
                yield Step(token, text[len(emitted) : cut])
                return
            ready = text.rstrip("\ufffd")  # an incomplete multi-byte character waits for its next token
            ready = ready[: max(len(emitted), len(ready) - hold)]
            yield Step(token, ready[len(emitted) :])
            emitted = ready
            if len(ids) >= self.cfg.max_new_tokens:
                break
            logits = self.adapter.decode([token], cache, position)[-1]  # [V]
            position += 1
            token = self.sample(logits)
        if len(text) > len(emitted):
            yield Step(None, text[len(emitted) :])


@torch.inference_mode()
def teacher_forced_logits(
    adapter: ModelAdapter, keys: list[torch.Tensor], values: list[torch.Tensor], first_logits: torch.Tensor,
    answer_ids: list[int],
) -> torch.Tensor:
    """The next-token logits at every position of `answer_ids` forced through a prompt cache (L x
    [H_kv, N, D]): the prompt's `first_logits` [V] predict the first answer token, the cache extended
    by the answer's tokens so far predicts each next one. Returns [T, V]; the cache is not changed."""
    if not answer_ids:
        raise ValueError("teacher forcing needs at least one answer token, got none")
    first = first_logits.float()[None]  # [1, V]
    if len(answer_ids) == 1:
        return first
    cache = adapter.make_cache(keys, values, room=len(answer_ids) - 1)
    rest = adapter.decode(answer_ids[:-1], cache, keys[0].shape[-2])  # [T-1, V]
    return torch.cat([first, rest])  # [T, V]
