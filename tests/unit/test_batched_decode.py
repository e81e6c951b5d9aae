"""Batched decoding (continuous batching): rows decoded together give what each gives alone.

`ModelAdapter.decode_rows` advances B sequences by one token with one forward step, their caches
slots of a `DecodePool` attended in one call a layer, each row over its own positions;
`decode_together` does it for `Decoder`s, each sampling by its own rule.
Rows have prompts of different lengths, join and leave between steps; a greedy row's tokens and
logits equal decoding it alone, a seeded sampled row's tokens equal its own alone, and a row
constrained to a JSON Schema stays inside it beside unconstrained ones.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_structured import SCHEMA, Reading

from rag_kvcache.config import GenerationConfig
from rag_kvcache.engine.decoding import DecodePool
from rag_kvcache.engine.generation import Decoder, Step, decode_together
from rag_kvcache.engine.model import ModelAdapter

LENGTHS = (7, 23, 40, 61)  # prompt tokens of the rows


def prompts(adapter: ModelAdapter, lengths=LENGTHS, seed: int = 0, low: int = 1000, high: int = 20000):
    """Per row: the prompt's keys, values (L x [1, H_kv, N, D]) and next-token logits [V]."""
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(low, high, (1, n), generator=torch.Generator().manual_seed(seed + i))
        keys, values, logits = adapter.prefill(ids)
        out.append((keys, values, logits[0]))
    return out


def test_decode_rows_alone_equals_the_transformers_forward(tiny):
    """A row decoded by `decode_rows` gets the logits of the model's own forward over an injected cache."""
    ((keys, values, _),) = prompts(tiny, (33,))
    reference, row = tiny.make_cache(keys, values, room=5), DecodePool().admit(keys, values, room=5)
    for step, token in enumerate([1100, 1200, 1300, 1400, 1500]):
        want = tiny.decode([token], reference, 33 + step)[-1]  # [V]
        torch.testing.assert_close(tiny.decode_rows([token], [row])[0], want, atol=1e-5, rtol=0)
    assert row.length == row.capacity == 38


def test_rows_of_different_lengths_joining_and_leaving_decode_as_alone(tiny):
    """Greedy rows with prompts of 7-61 tokens: row 2 joins after two steps, row 0 leaves after three;
    every row's logits at every step equal its logits decoding alone, so its tokens are the same."""
    rows = prompts(tiny)
    steps = 6
    alone = []
    for keys, values, logits in rows:
        cache, token, seen = DecodePool().admit(keys, values, room=steps), int(logits.argmax()), []
        for _ in range(steps):
            seen.append(tiny.decode_rows([token], [cache])[0])  # [V]
            token = int(seen[-1].argmax())
        alone.append(seen)
    pool = DecodePool()
    caches = [pool.admit(k, v, room=steps) for k, v, _ in rows]
    tokens = [int(logits.argmax()) for _, _, logits in rows]
    got: list[list[torch.Tensor]] = [[] for _ in rows]
    joins, leaves = {2: 2}, {0: 3}  # row -> the step it joins at / the number of steps it takes
    for step in range(steps + 2):
        active = [r for r in range(len(rows)) if joins.get(r, 0) <= step and len(got[r]) < leaves.get(r, steps)]
        if not active:
            break
        logits = tiny.decode_rows([tokens[r] for r in active], [caches[r] for r in active])  # [B, V]
        for r, row_logits in zip(active, logits):
            got[r].append(row_logits)
            tokens[r] = int(row_logits.argmax())
    assert [len(g) for g in got] == [3, steps, steps, steps]
    for r, (g, a) in enumerate(zip(got, alone)):
        for step, (x, y) in enumerate(zip(g, a)):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0, msg=f"row {r}, step {step}")
            assert int(x.argmax()) == int(y.argmax())


@pytest.mark.parametrize("shared", [True, False], ids=["one-pool", "a-pool-each"])
def test_rows_extended_by_several_tokens_equal_a_prefill_of_the_whole(tiny, shared):
    """Rows 0 and 2 of three cached prompts (7, 23, 40 tokens) extended by the same 5 tokens in one step
    (row 1 holds its slot and does not step): each row's last logits and its 5 new positions' K/V are
    those a prefill of its prompt and the 5 tokens gives; a decoding step after it goes on from there."""
    rows = prompts(tiny, (7, 23, 40))
    pool = DecodePool()
    caches = [(pool if shared else DecodePool()).admit(k, v, room=6) for k, v, _ in rows]
    extension = [1500, 1600, 1700, 1800, 1900]
    got = tiny.extend_rows([extension, extension], [caches[2], caches[0]])  # [2, V]
    assert [c.length for c in caches] == [12, 23, 45]
    for r, logits in ((2, got[0]), (0, got[1])):
        n = (7, 23, 40)[r]
        ids = torch.cat(
            [torch.randint(1000, 20000, (1, n), generator=torch.Generator().manual_seed(r)), torch.tensor([extension])],
            1,
        )  # the prompt `prompts` made, then the extension
        keys, values, want = tiny.prefill(ids)
        torch.testing.assert_close(logits, want[0], atol=1e-5, rtol=0, msg=f"row {r}")
        for layer in range(tiny.layout.n_layers):
            torch.testing.assert_close(caches[r].keys[layer][:, : n + 5], keys[layer][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(caches[r].values[layer][:, : n + 5], values[layer][0], atol=1e-5, rtol=0)
        after = tiny.decode_rows([2000], [caches[r]])[0]  # [V]
        torch.testing.assert_close(
            after, tiny.prefill(torch.cat([ids, torch.tensor([[2000]])], 1))[2][0], atol=1e-5, rtol=0
        )
    with pytest.raises(ValueError, match=r"at least 1 token in every row, got \[2, 0\]"):
        tiny.extend_rows([[1, 2], []], caches[:2])
    with pytest.raises(ValueError, match=r"decode caches \[0\] are full \(13 positions\): no room for 2 more"):
        tiny.extend_rows([[1, 2]], [caches[0]])


@pytest.mark.parametrize("shared", [True, False], ids=["one-pool", "two-pools"])
def test_a_step_of_rows_fed_different_numbers_of_tokens_equals_each_prefill(tiny, shared):
    """One step feeds four cached prompts 1, 9, 1 and 4 tokens (decoding rows beside prompt tails, in two pools
    or one): each row's last logits and new K/V are those a prefill of its prompt and its tokens gives."""
    rows = prompts(tiny)
    pools = [DecodePool(), DecodePool() if not shared else None]
    caches = [(pools[r % 2] or pools[0]).admit(k, v, room=10) for r, (k, v, _) in enumerate(rows)]
    fed = [[1500], [1600 + i for i in range(9)], [1700], [1800, 1801, 1802, 1803]]
    got = tiny.extend_rows(fed, caches)  # [4, V]
    assert [c.length for c in caches] == [n + len(f) for n, f in zip(LENGTHS, fed)]
    for r, n in enumerate(LENGTHS):
        ids = torch.cat(
            [torch.randint(1000, 20000, (1, n), generator=torch.Generator().manual_seed(r)), torch.tensor([fed[r]])], 1
        )  # the prompt `prompts` made, then what was fed
        keys, values, want = tiny.prefill(ids)
        torch.testing.assert_close(got[r], want[0], atol=1e-5, rtol=0, msg=f"row {r}")
        for layer in range(tiny.layout.n_layers):
            m = n + len(fed[r])
            torch.testing.assert_close(caches[r].keys[layer][:, :m], keys[layer][0], atol=1e-5, rtol=0)
            torch.testing.assert_close(caches[r].values[layer][:, :m], values[layer][0], atol=1e-5, rtol=0)


def test_a_decoder_started_with_a_prompt_tail_samples_its_first_token_in_a_batched_step(tiny):
    """A decoder whose prompt's last 7 tokens are not in its cache (`Decoder.start(tail=...)`) gets them fed by
    its first `decode_together` step, beside a decoding row: its first logits and greedy answer are those of a
    decoder started over the whole prompt's cache; a decoder with neither a first token nor a tail is refused."""
    ids = torch.randint(1000, 20000, (1, 40), generator=torch.Generator().manual_seed(1))
    cfg = GenerationConfig(max_new_tokens=6)
    keys, values, logits = tiny.prefill(ids)
    whole = Decoder(tiny, cfg)
    list(whole.steps([k[0] for k in keys], [v[0] for v in values], logits[0], whole.sample(logits[0])))
    ((k0, v0, first0),) = prompts(tiny, (23,))
    pool = DecodePool()
    other = Decoder(tiny, cfg)
    other.start([k[0] for k in k0], [v[0] for v in v0], pool)
    other.take(other.sample(first0))
    head_k, head_v, _ = tiny.prefill(ids[:, :33])
    tailed = Decoder(tiny, cfg)
    tailed.start([k[0] for k in head_k], [v[0] for v in head_v], pool, tail=ids[0, 33:].tolist())
    decode_together([other, tailed])
    torch.testing.assert_close(tailed.first_logits, logits[0], atol=1e-5, rtol=0)
    assert other.first_logits is None and tailed.tail == []
    while not tailed.done:
        decode_together([tailed])
    assert tailed.ids == whole.ids
    idle = Decoder(tiny, cfg)
    idle.start([k[0] for k in k0], [v[0] for v in v0], pool)
    with pytest.raises(ValueError, match=r"decoders \[0\] cannot step"):
        decode_together([idle])


def alone_logits(adapter: ModelAdapter, row, steps: int) -> list[torch.Tensor]:
    """A greedy row's next-token logits [V] at each of `steps` steps, decoded in a pool of its own."""
    keys, values, logits = row
    cache, token, seen = DecodePool().admit(keys, values, room=steps), int(logits.argmax()), []
    for _ in range(steps):
        seen.append(adapter.decode_rows([token], [cache])[0])  # [V]
        token = int(seen[-1].argmax())
    return seen


def test_a_freed_slot_taken_by_a_longer_row_while_others_decode(tiny):
    """Rows 0 and 1 decode; row 0 finishes and gives its slot back; row 2, longer than the pool's
    positions, takes it (the buffers grow, row 1's K/V so far copied over) and row 3 a new slot; rows
    3, 1, 2 decode on together: every row's logits equal its own alone, and the pool lets its buffers
    go once the last slot is given back."""
    rows = prompts(tiny, (9, 20, 70, 5))
    steps = 4
    alone = [alone_logits(tiny, row, 2 * steps if r == 1 else steps) for r, row in enumerate(rows)]
    pool = DecodePool()
    caches: dict[int, object] = {}
    tokens = {r: int(rows[r][2].argmax()) for r in range(len(rows))}
    got: dict[int, list[torch.Tensor]] = {r: [] for r in range(len(rows))}

    def step(active: list[int]) -> None:
        for r, logits in zip(active, tiny.decode_rows([tokens[r] for r in active], [caches[r] for r in active])):
            got[r].append(logits)
            tokens[r] = int(logits.argmax())

    caches[0] = pool.admit(*rows[0][:2], room=steps)
    caches[1] = pool.admit(*rows[1][:2], room=2 * steps)
    for _ in range(steps):
        step([0, 1])
    caches[0].close()
    caches[2] = pool.admit(*rows[2][:2], room=steps)
    caches[3] = pool.admit(*rows[3][:2], room=steps)
    assert [caches[2].slot, caches[3].slot, pool.size] == [0, 2, 3]
    assert pool.keys[0].shape[2] == 70 + steps  # grown to the longest row's positions
    for _ in range(steps):
        step([3, 1, 2])
    assert [len(got[r]) for r in got] == [steps, 2 * steps, steps, steps]
    for r in got:
        for i, (x, y) in enumerate(zip(got[r], alone[r])):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0, msg=f"row {r}, step {i}")
    for r in (1, 2, 3):
        caches[r].close()
        caches[r].close()  # idempotent
    assert pool.size == 0 and pool.keys == [] and pool.rows == []


def test_a_pool_under_steady_load_grows_its_slots_only_for_rows_in_flight():
    """Fault found under a served trace (16 clients, chats growing by a turn each): a newcomer longer than the
    pool's positions doubled its slots too, and a pool that never emptied grew to 256 slots (24 GB, the server
    killed by the kernel). Two rows in flight at a time, each new one longer than the last: 2 slots, always."""
    pool = DecodePool()

    def row(n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [torch.ones(2, n, 4)] * 3, [torch.ones(2, n, 4)] * 3  # 3 layers of [H_kv, N, D]

    held = pool.admit(*row(8), room=4)
    for n in range(9, 40):
        newcomer = pool.admit(*row(n), room=4)
        assert pool.keys[0].shape[:3] == (2, 2, n + 4)  # [S, H_kv, C]: a slot each, the newcomer's positions
        held.close()
        held = newcomer
    held.close()
    assert pool.keys == []


def run_alone(adapter: ModelAdapter, cfg: GenerationConfig, row) -> list[Step]:
    keys, values, logits = row
    decoder = Decoder(adapter, cfg)
    return list(decoder.steps(keys, values, logits, decoder.sample(logits)))


def run_together(
    adapter: ModelAdapter,
    cfgs: list[GenerationConfig],
    rows,
    join_at: list[int],
    shared: bool = True,
) -> list[list[Step]]:
    """Continuous batching as the server does it: decoder i starts (prefill done, first token taken)
    before step `join_at[i]`, into one shared pool (or each into its own); every step advances all
    started, unfinished decoders together; a decoder gives its slot back when it is done."""
    decoders = [Decoder(adapter, cfg) for cfg in cfgs]
    pool = DecodePool() if shared else None
    out: list[list[Step]] = [[] for _ in cfgs]
    step = 0
    while any(not d.done for d in decoders):
        for i, (d, (keys, values, logits)) in enumerate(zip(decoders, rows)):
            if join_at[i] == step:
                d.start(keys, values, pool)
                out[i] += d.take(d.sample(logits))
        active = [i for i, d in enumerate(decoders) if d.cache is not None and not d.done]
        if active:
            for i, released in zip(active, decode_together([decoders[i] for i in active])):
                out[i] += released
        for d in decoders:
            if d.done:
                d.close()
        step += 1
    assert pool is None or pool.size == 0
    return out


@pytest.mark.parametrize("shared", [True, False], ids=["one-pool", "a-pool-each"])
def test_decoders_batched_give_each_ones_own_answer(tiny, shared):
    """Greedy rows (one cut by a stop string, one by a small max_new_tokens) and seeded sampled rows,
    joining at different steps, their caches in one pool or each in its own (one attention call per
    pool): every row's steps (tokens and text) are those it gives alone."""
    rows = prompts(tiny, (7, 23, 40, 61, 15))
    greedy = run_alone(tiny, GenerationConfig(max_new_tokens=12), rows[1])
    stop = "".join(s.text for s in greedy).split()[2]  # a word its answer reaches, so it stops early there
    cfgs = [
        GenerationConfig(max_new_tokens=12),
        GenerationConfig(max_new_tokens=12, stop=(stop,)),
        GenerationConfig(max_new_tokens=3),
        GenerationConfig(max_new_tokens=10, temperature=1.0, seed=11),
        GenerationConfig(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=12),
    ]
    want = [run_alone(tiny, cfg, row) for cfg, row in zip(cfgs, rows)]
    got = run_together(tiny, cfgs, rows, join_at=[0, 0, 1, 3, 4], shared=shared)
    assert got == want
    assert sum(s.token_id is not None for s in got[1]) < 12 and stop not in "".join(s.text for s in got[1])
    assert sum(s.token_id is not None for s in got[2]) == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_json_schema_row_stays_constrained_beside_free_rows(bpe_tiny, temperature):
    """A row decoded under a JSON Schema batched with unconstrained rows decodes the document it
    decodes alone, valid against the schema; the free rows are unchanged by its mask."""
    high = len(bpe_tiny.tokenizer) - 1
    rows = prompts(bpe_tiny, (12, 30, 9), seed=3, low=0, high=high)
    cfgs = [
        GenerationConfig(max_new_tokens=200, temperature=temperature, seed=7, json_schema=SCHEMA),
        GenerationConfig(max_new_tokens=40),
        GenerationConfig(max_new_tokens=40, temperature=1.0, seed=5),
    ]
    want = [run_alone(bpe_tiny, cfg, row) for cfg, row in zip(cfgs, rows)]
    got = run_together(bpe_tiny, cfgs, rows, join_at=[1, 0, 2])
    assert got == want
    text = "".join(s.text for s in got[0])
    Reading.model_validate_json(text)
    assert json.loads(text).keys() <= Reading.model_fields.keys()


# ---- failures are loud ---------------------------------------------------------------------------------
def test_misuse_is_refused_with_the_bad_value(tiny):
    ((keys, values, logits),) = prompts(tiny, (10,))
    cache = DecodePool().admit(keys, values, room=1)
    tiny.decode_rows([1100], [cache])
    with pytest.raises(ValueError, match=r"decode caches \[0\] are full \(11 positions\)"):
        tiny.decode_rows([1200], [cache])
    with pytest.raises(ValueError, match="one row of tokens per cache, got 2 rows for 1 caches"):
        tiny.decode_rows([1, 2], [DecodePool().admit(keys, values, room=1)])
    with pytest.raises(ValueError, match=r"one sequence; got keys of shape \(2, "):
        DecodePool().admit([torch.cat([k, k]) for k in keys], [torch.cat([v, v]) for v in values], room=1)
    with pytest.raises(ValueError, match="room=0"):
        DecodePool().admit(keys, values, room=0)
    twice = DecodePool().admit(keys, values, room=2)
    with pytest.raises(ValueError, match="one cache twice"):
        tiny.decode_rows([1, 2], [twice, twice])
    twice.close()
    with pytest.raises(ValueError, match=r"decode caches \[0\] are closed"):
        tiny.decode_rows([1], [twice])

    done = Decoder(tiny, GenerationConfig(max_new_tokens=1))
    done.start(keys, values)
    done.take(int(logits.argmax()))
    assert done.done
    fresh = Decoder(tiny, GenerationConfig())
    fresh.start(keys, values)
    fresh.take(int(logits.argmax()))
    with pytest.raises(ValueError, match=r"decoders \[1, 2\] cannot step"):
        decode_together([fresh, done, Decoder(tiny, GenerationConfig())])
    with pytest.raises(RuntimeError, match="complete"):
        done.take(5)
    with pytest.raises(RuntimeError, match="already started"):
        done.start(keys, values)


def test_a_temperature_too_small_to_divide_by_decodes_greedily(tiny):
    """temperature 1.05e-37 passed validation; logits / T overflowed to inf and sampling raised (a 500)."""
    ((keys, values, logits),) = prompts(tiny, (19,))
    answers = []
    for temperature in (0.0, 1.05e-37, 1e-300):
        decoder = Decoder(tiny, GenerationConfig(max_new_tokens=6, temperature=temperature))
        answers.append([s.token_id for s in decoder.steps(keys, values, logits, decoder.sample(logits))])
    assert answers[1] == answers[2] == answers[0]


def test_a_request_whose_sampling_fails_fails_alone_in_its_batch(tiny):
    """One request's failing step (a sampler that raises on its row) failed every request in the batch."""
    rows = prompts(tiny, (11, 29))
    alone, together = [], []
    for keys, values, logits in rows:
        decoder = Decoder(tiny, GenerationConfig(max_new_tokens=5))
        alone.append([s.token_id for s in decoder.steps(keys, values, logits, int(logits.argmax()))])
    decoders = [Decoder(tiny, GenerationConfig(max_new_tokens=5)) for _ in rows]
    for decoder, (keys, values, logits) in zip(decoders, rows):
        decoder.start(keys, values)
        together.append([s.token_id for s in decoder.take(int(logits.argmax()))])

    def broken(row: torch.Tensor) -> int:
        raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")

    decoders[0].sample = broken
    first = decode_together(decoders)
    assert isinstance(first[0], RuntimeError) and decoders[0].done
    together[1] += [s.token_id for s in first[1]]
    while not decoders[1].done:  # the other goes on as if it had been alone
        (released,) = decode_together([decoders[1]])
        together[1] += [s.token_id for s in released]
    assert together[1] == alone[1]
