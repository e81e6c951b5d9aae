"""Prompt lookup (`GenerationConfig.draft_tokens`): a decoding step feeds, after the last token, the tokens that
followed its latest earlier occurrence in the prompt or answer, and takes those the logits before them choose.
The answer is the one decoding a token a step gives, in fewer steps where it repeats what came before; the K/V it
leaves are those token-by-token decoding leaves (a chat's next turn reads them); rows drafting or not share a
batched step and each answers as alone."""

from __future__ import annotations

import torch
from test_batched_decode import prompts, run_alone, run_together

from rag_kvcache.config import GenerationConfig
from rag_kvcache.engine.decoding import DecodePool
from rag_kvcache.engine.generation import Decoder, decode_together

# prompts of 30 random tokens with their first 15 again after them: seed 3's greedy answer on the tiny model
# repeats a run of itself, seed 1's does not
REPEATING, PLAIN = 3, 1


def looked_up(tiny, prompt: list[int], ids: list[int], draft_tokens: int = 3, max_new_tokens: int = 10, **cfg):
    decoder = Decoder(tiny, GenerationConfig(max_new_tokens=max_new_tokens, draft_tokens=draft_tokens, **cfg))
    decoder.prompt, decoder.ids = prompt, ids
    return decoder.draft()


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_last_tokens(tiny):
    prompt = [5, 6, 7, 8, 9, 6, 7, 1]
    assert looked_up(tiny, prompt, [6, 7]) == [1, 6, 7]  # [1, 6, 7] is new; [6, 7] last seen before the 1
    assert looked_up(tiny, prompt, [9, 6, 7]) == [1, 9, 6]  # three tokens seen before: what followed them
    assert looked_up(tiny, prompt, [8, 9]) == [6, 7, 1]  # [1, 8, 9] is new; [8, 9] seen at 3
    assert looked_up(tiny, prompt, [6, 7], max_new_tokens=4) == [1]  # room for 4 - 2 - 1 more after the next
    assert looked_up(tiny, prompt, [40]) == [] and looked_up(tiny, prompt, []) == []
    assert looked_up(tiny, prompt, [6, 7], draft_tokens=0) == []
    assert looked_up(tiny, prompt, [6, 7], temperature=1.0, seed=0) == []  # sampling: no drafts


def decode(tiny, seed: int, draft_tokens: int, max_new_tokens: int = 24):
    """A greedy answer to the seed's repeating prompt, decoded alone; the decoder and its number of steps."""
    ids = torch.randint(1000, 20000, (1, 30), generator=torch.Generator().manual_seed(seed))
    ids = torch.cat([ids, ids[:, :15]], 1)  # [1, 45]
    keys, values, logits = tiny.prefill(ids)
    decoder = Decoder(tiny, GenerationConfig(max_new_tokens=max_new_tokens, draft_tokens=draft_tokens))
    decoder.start([k[0] for k in keys], [v[0] for v in values], prompt=ids[0].tolist())
    decoder.take(decoder.sample(logits[0]))
    steps = 0
    while not decoder.done:
        decode_together([decoder])
        steps += 1
    return decoder, steps


def test_a_drafting_decoder_answers_as_one_token_a_step_in_fewer_steps_and_leaves_the_same_kv(tiny):
    for seed, fewer in ((REPEATING, True), (PLAIN, False)):
        plain, plain_steps = decode(tiny, seed, 0)
        drafting, steps = decode(tiny, seed, 4)
        assert drafting.ids == plain.ids and plain_steps == len(plain.ids) - 1
        assert (steps < plain_steps) is fewer
        n = plain.cache.length
        assert drafting.cache.length == n == 45 + len(plain.ids) - 1  # every token fed but the last
        for a, b in zip(drafting.cache.keys + drafting.cache.values, plain.cache.keys + plain.cache.values):
            torch.testing.assert_close(a[:, :n], b[:, :n], atol=1e-5, rtol=0)


def test_a_batched_step_feeds_no_drafts(tiny):
    alone, _ = decode(tiny, REPEATING, 4, max_new_tokens=10)
    ids = torch.randint(1000, 20000, (1, 30), generator=torch.Generator().manual_seed(REPEATING))
    ids = torch.cat([ids, ids[:, :15]], 1)  # [1, 45]
    keys, values, logits = tiny.prefill(ids)
    pool, decoders = DecodePool(), [Decoder(tiny, GenerationConfig(max_new_tokens=24, draft_tokens=4)) for _ in "ab"]
    for d in decoders:
        d.start([k[0] for k in keys], [v[0] for v in values], pool, prompt=ids[0].tolist())
        d.take(d.sample(logits[0]))
    while len(decoders[0].ids) < 10:  # its 10th token repeats its 5th
        decode_together(decoders)
        assert all(d.drafted == [] and d.cache.length == 45 + len(d.ids) - 1 for d in decoders)
    assert decoders[0].ids == alone.ids and decoders[0].draft()  # alone, it would draft now


def test_an_answer_cut_by_max_new_tokens_inside_a_draft_stops_there(tiny):
    plain, _ = decode(tiny, REPEATING, 0)
    for limit in range(2, 24):
        drafting, _ = decode(tiny, REPEATING, 4, max_new_tokens=limit)
        assert drafting.ids == plain.ids[:limit] and drafting.cache.length == 45 + limit - 1


def test_rows_that_may_draft_answer_as_each_alone_token_by_token(tiny):
    """Rows that may draft beside a greedy row that does not and a seeded sampled one (which never drafts), joining
    at different steps, in one pool (a batched step feeds no drafts; the last row left decodes alone and drafts):
    each row's steps are those it gives alone without drafting."""
    rows = prompts(tiny, (7, 23, 40, 61), low=1000, high=1100)  # a small vocabulary: the answers repeat
    cfgs = [
        GenerationConfig(max_new_tokens=16, draft_tokens=4),
        GenerationConfig(max_new_tokens=5, draft_tokens=8),
        GenerationConfig(max_new_tokens=12),
        GenerationConfig(max_new_tokens=10, temperature=1.0, seed=11, draft_tokens=4),
    ]
    want = [run_alone(tiny, GenerationConfig(**{**vars(cfg), "draft_tokens": 0}), row) for cfg, row in zip(cfgs, rows)]
    assert run_together(tiny, cfgs, rows, join_at=[0, 0, 1, 2]) == want
