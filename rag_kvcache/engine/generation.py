"""Decoding that continues from a fused prompt cache: greedy or sampled, stop strings, streaming,
optionally constrained to a JSON Schema; and teacher forcing, which scores a given answer from such a cache."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..config import GenerationConfig
from .constraints import JsonSchemaConstraint
from .decoding import DecodeCache, DecodePool
from .model import ModelAdapter


def sample_token(
    logits: torch.Tensor, cfg: GenerationConfig, rng: torch.Generator | None, allowed: torch.Tensor | None = None
) -> int:
    """Greedy argmax (`cfg.greedy`), else temperature + nucleus (top-p) sampling, of next-token logits [V],
    among the `allowed` tokens (bool [V]) when given. The most likely token is always kept, whatever `top_p`."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))  # [V]
    if cfg.greedy:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / cfg.temperature, dim=-1)  # [V]
    sorted_p, order = probs.sort(descending=True)  # [V]
    keep = sorted_p.cumsum(0) - sorted_p < cfg.top_p  # [V]
    keep[0] = True  # a top_p that float32 rounds to 0 once kept none: 0/0
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
    """Generates one answer from its prompt cache, a token at a time: the first token from the fused
    logits, the rest step by step; every token constrained to `cfg.json_schema` when it names one.

    `start` gives it the prompt's cache; `take` adds each sampled token and returns the text it
    releases, until `done` (end of sequence, a stop string, or `max_new_tokens`). `steps` runs that
    loop alone; `decode_together` advances several decoders by one batched model step, each with its
    own sampling rule, generator and constraint, so a decoder's tokens do not depend on its company.

    With `cfg.draft_tokens` (greedy and unconstrained decoding), a step feeds after the last token a draft
    (`draft`: what followed the answer's last tokens where they occur earlier in the prompt or the answer,
    prompt lookup) and takes the drafted tokens that the logits before them choose, then the token the logits
    after the last of them choose: one step, several tokens, the same answer (to float error in the logits).
    """

    def __init__(self, adapter: ModelAdapter, cfg: GenerationConfig) -> None:
        self.adapter = adapter
        self.cfg = cfg
        self.constraint = None
        if cfg.json_schema is not None:
            self.constraint = JsonSchemaConstraint(adapter.tokenizer, adapter.eos_token_ids, cfg.json_schema)
        self.rng = None
        if not cfg.greedy:
            self.rng = torch.Generator(device=adapter.device)
            if cfg.seed is not None:
                self.rng.manual_seed(cfg.seed)
            else:
                self.rng.seed()
        self.cache: DecodeCache | None = None
        self.tail: list[int] = []  # prompt tokens after the cache, fed by the first step (`start`)
        self.first_logits: torch.Tensor | None = None  # [V]: a step that fed the tail sampled the first token from them
        self.ids: list[int] = []  # the answer's tokens so far (end of sequence not included)
        self.prompt = np.empty(0, dtype=np.int64)  # [N]: the prompt's tokens, where drafts are looked up (`start`)
        self.drafted: list[int] = []  # the draft the last `feed` took
        self.drafts = cfg.draft_tokens if cfg.greedy and self.constraint is None else 0  # most tokens a draft
        self.done = False
        self._text = self._emitted = ""
        self._hold = max((len(s) - 1 for s in cfg.stop), default=0)  # chars that may start a stop string

    def sample(self, logits: torch.Tensor) -> int:
        """The next token from next-token logits [V], by the sampling rule, among those the constraint allows."""
        allowed = None if self.constraint is None else self.constraint.allowed(logits.shape[-1])  # [V]
        return sample_token(logits, self.cfg, self.rng, allowed)

    def start(
        self,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        pool: DecodePool | None = None,
        hidden: torch.Tensor | None = None,
        tail: Sequence[int] = (),
        prompt: Sequence[int] = (),
    ) -> DecodeCache:
        """Take the prompt's cache (per layer [H_kv, N, D]) into a slot of `pool` (the decoders it is
        stepped with share one, so their rows attend in one call; by default a pool of its own), with
        room for the tokens to come: the prompt's `tail`, tokens after the cache not yet computed, which
        its first step feeds (`feed`), and the answer's. `hidden` (bool [N]): prompt positions no later
        token attends to (`DecodePool.admit`). `prompt`: the prompt's tokens, where drafts are looked up
        (`cfg.draft_tokens`). Returns the cache; `close` gives its slot back."""
        if self.cache is not None:
            raise RuntimeError("this decoder has already started: one Decoder decodes one answer")
        room = len(tail) + self.cfg.max_new_tokens
        self.cache = (pool or DecodePool()).admit(keys, values, room=room, hidden=hidden)
        self.tail = list(tail)
        self.prompt = np.asarray(prompt, dtype=np.int64)  # [N]
        return self.cache

    def feed(self, draft: bool = False) -> list[int]:
        """The tokens this decoder's next step feeds, taken: the prompt's tail (its first step: the logits
        after it give the first token), else the last token taken (none before the first), and with `draft`
        its `draft` after it."""
        tail, self.tail = self.tail, []
        self.drafted = self.draft() if draft and not tail else []
        return tail or self.ids[-1:] + self.drafted

    def draft(self) -> list[int]:
        """At most `drafts` tokens, and no more than the answer has room for after the next: those that
        followed the latest earlier occurrence of the answer's last 3 tokens (else 2, else 1) in the prompt and
        the answer so far; none when they occur nowhere before."""
        room = min(self.drafts, self.cfg.max_new_tokens - len(self.ids) - 1)
        if room < 1 or not self.ids:
            return []
        seq = np.concatenate([self.prompt, np.asarray(self.ids, dtype=np.int64)])  # [T]
        t = len(seq)
        for n in (3, 2, 1):
            if t <= n:
                continue
            starts = seq[: t - n] == seq[t - n]  # [T - n]: where an earlier run of n could start
            for j in range(1, n):
                starts &= seq[j : t - n + j] == seq[t - n + j]
            if (at := np.flatnonzero(starts)).size:
                return seq[at[-1] + n : at[-1] + n + room].tolist()
        return []

    def close(self) -> None:
        """Give the cache's slot back to its pool (a shared pool's next decoder takes it); idempotent."""
        if self.cache is not None:
            self.cache.close()

    def take(self, token: int) -> list[Step]:
        """Add the sampled `token` to the answer; returns the steps it releases, the flush of held-back
        text included once the answer is complete (`done`)."""
        if self.done:
            raise RuntimeError(f"the answer is complete ({len(self.ids)} tokens); token {token} cannot be added")
        if token in self.adapter.eos_token_ids:
            self.done = True
            return self._flush()
        if self.constraint is not None:
            self.constraint.advance(token)
        self.ids.append(token)
        self._text = text = self.adapter.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.cfg.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.done = True
            return [Step(token, text[len(self._emitted) : cut])]
        ready = text.rstrip("\ufffd")  # an incomplete multi-byte character waits for its next token
        ready = ready[: max(len(self._emitted), len(ready) - self._hold)]
        step = Step(token, ready[len(self._emitted) :])
        self._emitted = ready
        if len(self.ids) >= self.cfg.max_new_tokens:
            self.done = True
            return [step, *self._flush()]
        return [step]

    def _flush(self) -> list[Step]:
        rest = self._text[len(self._emitted) :]
        self._emitted = self._text
        return [Step(None, rest)] if rest else []

    def steps(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], first_logits: torch.Tensor, first_token: int
    ) -> Iterator[Step]:
        """Yield decoded steps, `first_token` (already sampled from `first_logits`, by `sample` when
        constrained) included, decoding alone.

        Stops at an end-of-sequence token, a stop string (its text is cut), or `max_new_tokens`.
        """
        self.start(keys, values)
        yield from self.run(first_token)

    def run(self, first_token: int | None) -> Iterator[Step]:
        """Take `first_token` (None: started with a prompt tail, the first step samples it), then decode alone
        (batches of one) until the answer is complete."""
        released = [] if first_token is None else self.take(first_token)
        while True:
            yield from released
            if self.done:
                return
            (released,) = decode_together([self])
            if isinstance(released, Exception):
                raise released


def decode_together(decoders: Sequence[Decoder]) -> list[list[Step] | Exception]:
    """Advance started, unfinished decoders of one model with one batched step (`ModelAdapter.extend_rows`):
    each feeds its last token, or its prompt's tail when it started with one (`Decoder.start`: its first
    token is sampled here, from logits it keeps as `first_logits`), samples the next from its own row of
    logits by its own rule (generator, constraint) and takes it. Returns the steps each released, or in
    its place the error a decoder's own sampling raised: that decoder is done, and the others' rows are
    untouched by it (one request's failure stays its own).

    A step of one decoder feeds its draft too (`GenerationConfig.draft_tokens`): one row reads every weight for a
    token or three alike, so the drafted tokens it keeps are nearly free. A batched step's rows already share the
    weights' reads, and drafts there would add compute for every row, so none is fed (benchmarks/RESULTS.md)."""
    if not decoders:
        raise ValueError("decode_together needs at least one decoder")
    idle = [i for i, d in enumerate(decoders) if d.cache is None or d.done or not (d.ids or d.tail) or not d.cache.open]
    if idle:
        raise ValueError(
            f"decoders {idle} cannot step: not started, complete, closed, or without a first token or a prompt tail"
        )
    firsts = [bool(d.tail) for d in decoders]
    fed = [d.feed(draft=len(decoders) == 1) for d in decoders]  # drafts in a step of one row (see the docstring)
    keep = [1 + len(d.drafted) for d in decoders]  # a drafting row: the logits after its last token and each draft
    logits = decoders[0].adapter.extend_rows(fed, [d.cache for d in decoders], keep).split(keep)  # B x [n, V]
    for d, rows, first in zip(decoders, logits, firsts):
        if first:
            d.first_logits = rows[0]
    return [_advance(d, rows) for d, rows in zip(decoders, logits)]


def _advance(decoder: Decoder, logits: torch.Tensor) -> list[Step] | Exception:
    """`decoder` samples from its rows of logits [1 + drafted, V] and takes the tokens: the first, then while the
    token taken is the draft's next, the one after it; the positions of the draft tokens not taken are given back.
    Its error, if any, returned."""
    try:
        steps: list[Step] = []
        drafted, taken = decoder.drafted, 0
        for row in logits:  # the logits after the last token and `taken` drafted ones [V]
            token = decoder.sample(row)
            steps += decoder.take(token)
            if decoder.done or taken == len(drafted) or token != drafted[taken]:
                break
            taken += 1
        if drafted and (cache := decoder.cache) is not None:  # (a decoder drafts once started)
            cache.length -= len(drafted) - taken  # the positions of the drafts not taken: not the answer's
        return steps
    except Exception as err:  # its own rule failed on its own row (a constraint, a sampler): it alone ends
        decoder.done = True
        return err


@torch.inference_mode()
def teacher_forced_logits(
    adapter: ModelAdapter,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    first_logits: torch.Tensor,
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
