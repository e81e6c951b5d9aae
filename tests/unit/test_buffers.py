"""The K/V buffer pool: memory is handed out again only once nothing but the pool holds it, so a fused
result someone keeps (a second prompt fused meanwhile, another thread's fusion) is never overwritten."""

from __future__ import annotations

import threading

import pytest
import torch
from test_fusion import rag_prompt
from test_pipeline import docs, index  # noqa: F401

from rag_kvcache.config import FusionConfig
from rag_kvcache.engine.buffers import KVBufferPool
from rag_kvcache.engine.fusion import DirectReader
from rag_kvcache.engine.methods import get_method
from rag_kvcache.query.generator import FusedGenerator

SHAPE = (2, 3, 40, 8)


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def test_a_buffer_let_go_is_handed_out_again():
    pool = KVBufferPool(2)
    first = pool.take(SHAPE, torch.float32, "cpu")
    ptr = first.untyped_storage().data_ptr()
    del first
    again = pool.take(SHAPE, torch.float32, "cpu")
    assert again.untyped_storage().data_ptr() == ptr and again.shape == SHAPE


@pytest.mark.parametrize("keep", ["view", "unbound", "slice", "numpy"])
def test_a_buffer_any_view_of_which_lives_is_not_handed_out(keep):
    """Whatever derived view of a buffer survives (the fusion's unbind into K and V, a decoder's slice,
    a numpy array for scoring), the buffer stays out of the pool's hands."""
    pool = KVBufferPool(2)
    buf = pool.take(SHAPE, torch.float32, "cpu").zero_()
    views = {"view": buf.view(-1), "unbound": buf.unbind(0)[1], "slice": buf[1, :, 5:9], "numpy": buf.numpy()}
    kept = views.pop(keep)
    del buf, views
    fresh = pool.take(SHAPE, torch.float32, "cpu")
    assert fresh.untyped_storage().data_ptr() != torch.as_tensor(kept).untyped_storage().data_ptr()
    fresh.fill_(7.0)
    assert (torch.as_tensor(kept) == 0).all()


def test_limit_grow_and_kind():
    none = KVBufferPool(0)
    a = none.take(SHAPE, torch.float32, "cpu")
    ptr = a.untyped_storage().data_ptr()
    b = none.take(SHAPE, torch.float32, "cpu")  # `a` still held: other memory
    assert b.untyped_storage().data_ptr() != ptr
    pool = KVBufferPool(1)
    small = pool.take((2, 3, 10, 8), torch.float32, "cpu")
    del small
    big = pool.take(SHAPE, torch.float32, "cpu")  # the idle buffer is too small: replaced by a larger one
    ptr = big.untyped_storage().data_ptr()
    del big
    smaller = pool.take((2, 3, 10, 8), torch.float32, "cpu")  # a view of the larger one
    assert smaller.untyped_storage().data_ptr() == ptr and smaller.shape == (2, 3, 10, 8)
    del smaller
    half = pool.take(SHAPE, torch.bfloat16, "cpu")  # the kept buffer is free again but float32: replaced
    assert half.dtype == torch.bfloat16
    other = pool.take(SHAPE, torch.bfloat16, "cpu")  # limit 1 and that one held: a new buffer
    assert not same_memory(other, half)
    ptr = half.untyped_storage().data_ptr()
    del half, other
    assert pool.take(SHAPE, torch.bfloat16, "cpu").untyped_storage().data_ptr() == ptr
    with pytest.raises(ValueError, match="limit=-1"):
        KVBufferPool(-1)


def test_pooled_fusion_equals_fresh_memory_and_kept_results_do_not_change(tiny):
    """Two prompts fused one after the other through one pool whose buffers start full of NaN: each
    result equals the fusion into new memory bit for bit (every position is written before it is read),
    the second fusion reuses no memory the first result still holds, and the first result, kept,
    is unchanged after the second; once let go, its memory serves the next prompt."""
    pool = KVBufferPool(tiny.layout.n_layers)
    first_in, second_in = rag_prompt(tiny, seed=1), rag_prompt(tiny, seed=2, chunk_len=30)
    shape = (2, tiny.layout.n_kv_heads, max(first_in.n_tokens, second_in.n_tokens), tiny.layout.head_dim)
    poisoned = [pool.take(shape, tiny.dtype, "cpu").fill_(float("nan")) for _ in range(tiny.layout.n_layers)]
    del poisoned
    method, cfg = get_method("cacheblend"), FusionConfig(method="cacheblend", ratio=0.3)

    def fused(inp, pool):
        return method(tiny, inp, cfg, reader=DirectReader(inp.sources, inp.placement(tiny), pool))

    first = fused(first_in, pool)
    snapshot = [t.clone() for t in first.keys + first.values]
    second = fused(second_in, pool)
    for pooled, fresh in ((first, fused(first_in, KVBufferPool(0))), (second, fused(second_in, KVBufferPool(0)))):
        torch.testing.assert_close(pooled.logits, fresh.logits, atol=0, rtol=0)
        for a, b in zip(pooled.keys + pooled.values, fresh.keys + fresh.values):
            torch.testing.assert_close(a, b, atol=0, rtol=0)
    held = {t.untyped_storage().data_ptr() for t in first.keys}
    assert not held & {t.untyped_storage().data_ptr() for t in second.keys}
    for a, b in zip(first.keys + first.values, snapshot):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    del first, a, b
    third = fused(second_in, pool)
    assert {t.untyped_storage().data_ptr() for t in third.keys} == held


def test_generator_threads_fusing_at_once_get_their_own_answers(index):
    """Two threads fuse different questions through one generator (one pool) at the same time, again and
    again, letting each result go but the first: every result equals its question fused alone, and each
    thread's first result, kept through all the later fuses of both threads, is unchanged at the end."""
    gen = FusedGenerator(index)
    tiny = index.adapter
    fmt, cfg = index.format, FusionConfig(method="cacheblend", ratio=0.3)
    prompts = [
        fmt.segments([h.chunk.token_ids for h in index.search(q, 3)], fmt.question_ids(tiny.tokenizer, q))
        for q in ("Who kept the lighthouse diary?", "What does the bakery in Saltmere sell?")
    ]
    alone = [FusedGenerator(index).fuse(p, cfg).result for p in prompts]
    kept: dict[int, object] = {}
    failures: list[BaseException] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait()
            kept[i] = gen.fuse(prompts[i], cfg).result
            for _ in range(8):
                same(gen.fuse(prompts[i], cfg).result, alone[i])
        except BaseException as err:  # raised in the test's thread below
            failures.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    for i, result in kept.items():
        same(result, alone[i])


def same(a, b) -> None:
    """Equal fusion results (to float tolerance: two threads may split a kernel's work differently; a
    buffer overwritten by another prompt differs by far more)."""
    torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=1e-5)
    for x, y in zip(a.keys + a.values, b.keys + b.values, strict=True):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
