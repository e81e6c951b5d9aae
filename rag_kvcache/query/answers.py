"""What answering produces: an `Answer` with its numbers (timings, tokens read and computed, the chunks it
came from), a fused prompt cache (`Fused`), an answer under way (`Generation`), the `Answer` that ends a stream of
text (`collect_answer`), and the error of a prompt too long for the model."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace

import torch

from ..engine.decoding import DecodePool
from ..engine.fusion import FusionResult
from ..engine.generation import Decoder
from ..errors import RagKVCacheError


class PromptTooLongError(RagKVCacheError, ValueError):
    """A prompt (with the tokens to generate) longer than the model's context."""


@dataclass(frozen=True)
class RetrievedChunk:
    id: str
    source: str
    score: float


@dataclass(frozen=True)
class Answer:
    answer: str
    method: str
    ttft_s: float  # question in -> first token out: cache loading, fusion and first sampling included
    retrieval_s: float
    prompt_tokens: int
    recomputed_tokens: int
    compute_fraction: float
    generation_s: float
    generated_tokens: int
    cache_misses: int
    cache_computed_tokens: int = 0  # prompt tokens whose cache was computed for this prompt (a new head, a repair)
    conversation_tokens: int = 0  # prompt tokens read from the conversation cache (an earlier turn's K/V)
    finish_reason: str = "stop"  # "length": stopped at max_new_tokens; "stop": end of sequence or a stop string
    chunks: list[RetrievedChunk] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)  # seconds per stage of the prefill
    first_token_logits: torch.Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the cache (never computed at query time). A cache computed for this
        prompt (a cold chunk) may hold tokens the fusion recomputes too, counted in both: then this is a lower
        bound, never below 0."""
        return max(0, self.prompt_tokens - self.recomputed_tokens - self.cache_computed_tokens)

    @property
    def usage(self) -> dict[str, int]:
        """Token counts, named as OpenAI's API names them."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.generated_tokens,
            "total_tokens": self.prompt_tokens + self.generated_tokens,
            "cached_tokens": self.cached_tokens,
        }

    @property
    def fusion_stats(self) -> dict[str, object]:
        """What the fusion did and what it cost (the integrations' response metadata)."""
        return {
            "method": self.method,
            "ttft_s": self.ttft_s,
            "recomputed_tokens": self.recomputed_tokens,
            "conversation_tokens": self.conversation_tokens,
            "compute_fraction": self.compute_fraction,
            "cache_misses": self.cache_misses,
            "generation_s": self.generation_s,
            "stages": self.stages,
        }

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("first_token_logits")
        return out


@dataclass(frozen=True)
class Fused:
    """A fused prompt cache: the fusion's result, the prompt's length, and how many chunk caches
    were missing or corrupt (recomputed and stored again before use; the prefix is not counted)."""

    result: FusionResult
    prompt_tokens: int
    cache_misses: int
    cache_computed_tokens: int = 0  # prompt tokens of caches computed when opened (a new head, a repair)
    conversation_tokens: int = 0  # prompt tokens read from the conversation cache


@dataclass
class PendingKV:
    """A fused prompt's K/V (per layer [H_kv, N, D]) that `FusedGenerator.start` has not yet given to its decoder
    (a slot of `pool`) and to the conversation cache: that waits until the first token is out
    (`FusedGenerator.settle`, which then lets them go)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    pool: DecodePool | None


@dataclass(frozen=True)
class Generation:
    """An answer under way (`FusedGenerator.start`): its prompt fused, its first token sampled and not
    yet taken by its decoder; `fused` keeps the fusion's numbers (not its K/V: the decoder holds them, or
    `pending` until `FusedGenerator.settle`)."""

    decoder: Decoder
    first_token: int | None  # None: the decoder's first batched step samples and takes it (`FusedGenerator.enter`)
    method: str
    fused: Fused
    started: float  # time.perf_counter() when the fusion began
    ttft_s: float
    ids: tuple[int, ...]  # the prompt's tokens (empty where nothing keeps them: a shared prompt's answer)
    salt: str  # the tenant (`FusedGenerator.start`)
    pending: PendingKV | None = None  # the decoder not yet started (`FusedGenerator.settle`)


def collect_answer(steps: Iterator[str | Answer], on_text: Callable[[str], None] | None) -> Answer:
    """The `Answer` that ends `FusedGenerator.stream`'s `steps`, with the streamed text as its answer;
    `on_text` receives each piece of text as it comes."""
    pieces: list[str] = []
    for step in steps:
        if isinstance(step, Answer):
            return replace(step, answer="".join(pieces).strip())
        pieces.append(step)
        if on_text is not None and step:
            on_text(step)
    raise AssertionError("stream() always ends with an Answer")
