"""Decoding steps' products in the narrow form: a weight's own [out, in] layout times a few columns.

`narrow_product` computes what `torch.mm` does for a few rows; an adapter takes it for steps of at most
`NARROW_ROWS` rows where the machine computes its LM head faster so (`narrow_is_faster`, by `prefer_narrow`),
and a model too small for it to matter keeps `torch.mm` whatever the timer says. An adapter in the narrow form
decodes what the model's own forward gives.
"""

from __future__ import annotations

import pytest
import torch
from tiny_model import tiny_llama

from rag_kvcache.engine.decoding import DecodePool
from rag_kvcache.engine.model import ModelAdapter
from rag_kvcache.engine.weights import NARROW_ROWS, narrow_is_faster, narrow_product, prefer_narrow


@pytest.mark.parametrize("rows", range(1, NARROW_ROWS + 1))
def test_narrow_product_equals_the_matrix_product(rows):
    """Every form a weight takes in the adapter: a transposed [out, in] matrix, and a column slice of one (the
    fused q, k, v weight's k and v columns)."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g)  # [M, in]
    fused = torch.randn(96, 64, generator=g).t()  # [in, out], a view of a contiguous [out, in]
    for weight in (fused, fused[:, 32:], fused[:, :32]):
        got = narrow_product(x, weight)  # [M, out]
        assert got.shape == (rows, weight.shape[1]) and got.is_contiguous()
        torch.testing.assert_close(got, x @ weight, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("wide_s", "narrow_s", "narrow"),
    [
        (9.8e-3, 3.4e-3, True),  # SmolLM2's LM head at one row on an AMD Zen 4 (session 47)
        (3.4e-3, 3.3e-3, False),  # as fast: not worth another kernel
        (3.0e-3, 2.2e-3, False),  # a quarter faster, but by 0.8 ms: no
        (4.0e-3, 2.9e-3, True),  # a quarter faster, by 1.1 ms
        (1.0e-4, 1.0e-5, False),  # 10x faster, but by 0.09 ms: a small model's, where noise could decide
    ],
)
def test_prefer_narrow_needs_a_quarter_and_a_millisecond(wide_s, narrow_s, narrow):
    assert prefer_narrow(wide_s, narrow_s) is narrow


def test_a_model_too_small_to_tell_keeps_torch_mm(tiny):
    """The tiny model's LM head takes microseconds either way: never the narrow form, run after run."""
    head = tiny.model.lm_head.weight.detach().t()  # [in, out]
    assert not tiny.narrow
    assert not any(narrow_is_faster(head) for _ in range(5))


def test_narrow_decoding_equals_the_transformers_forward(tokenizer):
    """An adapter in the narrow form: one-token steps and a three-token step (a draft verified) give the logits
    of the model's own forward over an injected cache."""
    adapter = ModelAdapter(tiny_llama(), tokenizer, name="tiny-llama", narrow=True)
    ids = torch.randint(1000, 20000, (1, 29), generator=torch.Generator().manual_seed(0))
    keys, values, _ = adapter.prefill(ids)
    reference, row = adapter.make_cache(keys, values, room=6), DecodePool().admit(keys, values, room=6)
    for step, token in enumerate([1100, 1200, 1300]):
        want = adapter.decode([token], reference, 29 + step)[-1]  # [V]
        torch.testing.assert_close(adapter.decode_rows([token], [row])[0], want, atol=1e-5, rtol=0)
    want = adapter.decode([1400, 1500, 1600], reference, 32)  # [3, V]
    torch.testing.assert_close(adapter.extend_rows([[1400, 1500, 1600]], [row], keep=[3]), want, atol=1e-5, rtol=0)
    assert row.length == row.capacity == 35
