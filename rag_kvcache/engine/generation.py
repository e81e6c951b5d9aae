"""Decoding that continues from a fused prompt cache: greedy or sampled, stop strings, streaming; and
teacher forcing, which scores a given answer from such a cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import GenerationConfig
from .model import ModelAdapter


def sample_token(logits: torch.Tensor, cfg: GenerationConfig, rng: torch.Generator | None) -> int:
    """Greedy argmax at temperature 0, else temperature + nucleus (top-p) sampling, of next-token logits [V]."""
    if cfg.temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)  # [V]
    sorted_p, order = probs.sort(descending=True)  # [V]
    keep = sorted_p.cumsum(0) - sorted_p < cfg.top_p  # [V], always keeps the top token
    sorted_p = sorted_p * keep
    choice = torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=rng)  # [1]
    return int(order[choice])


@dataclass(frozen=True)
class Step:
    """One generated token and the new text it releases (empty while held back); a final step with
    `token_id=None` flushes text held back because it might have begun a stop string."""

    token_id: int | None
    text: str


class Decoder:
    """Generates from a prompt cache: the first token from the fused logits, the rest step by step."""

    def __init__(self, adapter: ModelAdapter, cfg: GenerationConfig) -> None:
        self.adapter = adapter
        self.cfg = cfg
        self.rng = None
        if cfg.temperature > 0:
            self.rng = torch.Generator(device=adapter.device)
            if cfg.seed is not None:
                self.rng.manual_seed(cfg.seed)
            else:
                self.rng.seed()

    def steps(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], first_logits: torch.Tensor, first_token: int
    ) -> Iterator[Step]:
        """Yield decoded steps, `first_token` (already sampled from `first_logits`) included.

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
            token = sample_token(logits, self.cfg, self.rng)
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
