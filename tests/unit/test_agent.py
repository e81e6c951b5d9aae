"""One fused prompt for an agent's relevance checks and its answer (`rag_kvcache.query.agent.SharedPrompt`): hiding a
chunk is an attention mask over its tokens. Over a `full` prefill both steps equal the model run over the same
tokens with that mask; keeping every chunk decodes the fused prompt as it is; what is left visible is the prompt of
the kept chunks alone; the masked K/V are never kept as the prompt's own."""

from __future__ import annotations

import pytest
import torch
from test_faults import CFG, QUESTION, write_docs

from rag_kvcache.config import FusionConfig, GenerationConfig
from rag_kvcache.engine.decoding import DecodePool
from rag_kvcache.errors import RagKVCacheError
from rag_kvcache.index import KVIndex
from rag_kvcache.query.agent import SharedPrompt
from rag_kvcache.query.answers import PromptTooLongError
from rag_kvcache.query.generator import FusedGenerator
from rag_kvcache.query.relevance import RELEVANCE_CHECK, RelevanceCheck
from rag_kvcache.store.conversations import ConversationCache

FULL = FusionConfig(method="full")
SIX = GenerationConfig(max_new_tokens=6)


@pytest.fixture(scope="module")
def generator(tiny, tmp_path_factory) -> FusedGenerator:
    root = tmp_path_factory.mktemp("agent")
    index = KVIndex.build(write_docs(root / "docs", 4), root / "index", CFG, adapter=tiny, progress=False)
    return FusedGenerator(index)


@pytest.fixture(scope="module")
def chunks(generator):
    return [hit.chunk for hit in generator.index.search(QUESTION, 3)]


def ids_of(prompt: SharedPrompt) -> list[int]:
    fmt, tokenizer = prompt.generator.index.format, prompt.generator.adapter.tokenizer
    segments = fmt.segments([c.token_ids for c in prompt.chunks], fmt.question_ids(tokenizer, prompt.question))
    return [t for s in segments for t in s.ids]


@torch.inference_mode()
def masked_forward(model, ids: list[int], head: int, hidden: torch.Tensor) -> torch.Tensor:
    """transformers' own forward over `ids` with a 4D attention mask: causal, and the tokens after the first `head`
    never see the `hidden` ones among them. The next-token logits at every position [T, V]."""
    t = len(ids)
    visible = torch.ones(t, t, dtype=torch.bool).tril()  # [T, T]
    visible[head:, :head] &= ~hidden  # [T - head, head]
    mask = torch.zeros(1, 1, t, t).masked_fill(~visible, torch.finfo(torch.float32).min)  # [1, 1, T, T]
    return model(input_ids=torch.tensor([ids]), attention_mask=mask, position_ids=torch.arange(t)[None]).logits[0]


def test_the_answer_with_hidden_chunks_is_the_model_with_an_attention_mask_over_them(generator, chunks):
    """Over a `full` prefill, hiding chunk 1 of 3: the first-token logits and the greedy answer equal transformers'
    forward over the same tokens, the question and every answer token masked from chunk 1 and its separator."""
    prompt = SharedPrompt(generator, QUESTION, chunks, FULL)
    answer = prompt.answer({0, 2}, SIX)
    hidden, ids = prompt.hidden({0, 2}), ids_of(prompt)
    assert hidden.sum() == len(chunks[1].token_ids) + len(generator.index.format.separator_ids)
    want = masked_forward(generator.adapter.model, ids, prompt.head, hidden)[-1]  # [V]
    torch.testing.assert_close(answer.first_token_logits.float(), want.float(), atol=1e-4, rtol=1e-4)
    tokens = []
    for _ in range(SIX.max_new_tokens):  # greedy, each step over the prompt and the answer so far
        token = int(masked_forward(generator.adapter.model, ids + tokens, prompt.head, hidden)[-1].argmax())
        if token in generator.adapter.eos_token_ids:
            break
        tokens.append(token)
    assert answer.answer == generator.adapter.tokenizer.decode(tokens, skip_special_tokens=True).strip()
    assert answer.generated_tokens == len(tokens)
    forced = prompt.forced_logits({0, 2}, tokens + [0])  # teacher forcing reads the same masked prompt
    want = masked_forward(generator.adapter.model, ids + tokens, prompt.head, hidden)[len(ids) - 1 :]  # [T, V]
    torch.testing.assert_close(forced, want.float(), atol=1e-4, rtol=1e-4)


def test_each_check_sees_its_chunk_alone_in_the_shared_prompt(generator, chunks):
    """A check row hides every other chunk, the separators and the question: over a `full` prefill its verdict
    equals transformers' forward over the head and the check question with that mask."""
    prompt = SharedPrompt(generator, QUESTION, chunks, FULL)
    check = RelevanceCheck(generator)
    verdicts = prompt.check(check)
    fmt, tokenizer = generator.index.format, generator.adapter.tokenizer
    question = list(fmt.question_ids(tokenizer, RELEVANCE_CHECK.format(question=QUESTION)))
    head = ids_of(prompt)[: prompt.head]
    assert [v.chunk for v in verdicts] == chunks
    for i, verdict in enumerate(verdicts):
        hidden = prompt.hidden({i})
        assert (~hidden).sum() == len(fmt.prefix_ids) + len(chunks[i].token_ids)  # the prefix and chunk i
        logits = masked_forward(generator.adapter.model, head + question, prompt.head, hidden)[-1:]  # [1, V]
        assert verdict.p_yes == pytest.approx(float(check.p_yes(logits)[0]), abs=1e-4)
        assert verdict.computed_tokens == len(question)
        assert verdict.relevant == (verdict.p_yes >= check.threshold)


def test_keeping_every_chunk_decodes_the_fused_prompt_as_it_is(generator, chunks):
    fusion = FusionConfig(method="cacheblend", ratio=0.3)
    prompt = SharedPrompt(generator, QUESTION, chunks, fusion)
    answer = prompt.answer(range(len(chunks)), SIX)
    fmt, tokenizer = generator.index.format, generator.adapter.tokenizer
    alone = FusedGenerator(generator.index).stream(
        fmt.segments([c.token_ids for c in chunks], fmt.question_ids(tokenizer, QUESTION)), fusion, SIX
    )
    *pieces, reference = list(alone)
    assert answer.answer == "".join(pieces).strip()
    assert torch.equal(answer.first_token_logits, reference.first_token_logits)
    assert answer.recomputed_tokens == reference.recomputed_tokens


@pytest.mark.parametrize("keep", [(0, 2), (1, 2), (1,), (2,), (), (0, 1, 2)])
def test_what_is_left_visible_is_the_prompt_of_the_kept_chunks_alone(generator, chunks, keep):
    prompt = SharedPrompt(generator, QUESTION, chunks, FULL)
    visible = [t for t, h in zip(ids_of(prompt), prompt.hidden(set(keep)).tolist()) if not h]
    fmt, tokenizer = generator.index.format, generator.adapter.tokenizer
    alone = fmt.segments([chunks[i].token_ids for i in keep], fmt.question_ids(tokenizer, QUESTION))
    assert visible == [t for s in alone[:-1] for t in s.ids]


def test_a_masked_answer_is_not_kept_as_the_prompts_own(generator, chunks):
    """The conversation cache keys K/V by the prompt's tokens: a masked answer's question K/V are not the prompt's,
    so a later prompt over the same tokens must not read them (an unmasked answer's are kept)."""
    chatty = FusedGenerator(generator.index, ConversationCache(1 << 26))
    prompt = SharedPrompt(chatty, QUESTION, chunks, FULL)
    prompt.answer({0}, SIX)
    assert chatty.conversations.stats.tokens == 0  # nothing kept, under any tokens
    fmt, tokenizer = generator.index.format, generator.adapter.tokenizer
    segments = fmt.segments([c.token_ids for c in chunks], fmt.question_ids(tokenizer, QUESTION))
    list(chatty.stream(segments, FULL, SIX))
    assert chatty.conversations.held("", ids_of(prompt)) == len(ids_of(prompt)) - 1  # all but the last token


def test_bad_input_is_refused_with_the_value(generator, chunks):
    prompt = SharedPrompt(generator, QUESTION, chunks, FULL)
    with pytest.raises(RagKVCacheError, match=r"chunks \[3\] are not among the prompt's 3"):
        prompt.answer({0, 3}, SIX)
    with pytest.raises(RagKVCacheError, match="at least one chunk"):
        SharedPrompt(generator, QUESTION, [], FULL)
    with pytest.raises(PromptTooLongError, match=r"beyond the 4096 of model 'tiny-llama'"):
        SharedPrompt(generator, QUESTION, chunks[:1] * 200, FULL)  # refused before anything is fused
    with pytest.raises(PromptTooLongError, match="and up to 5000 more may be generated"):
        prompt.answer({0}, GenerationConfig(max_new_tokens=5000))
    keys = [torch.zeros(2, 5, 4)]
    with pytest.raises(ValueError, match="hidden must be a bool mask over the prompt's 5 positions"):
        DecodePool().admit(keys, keys, room=1, hidden=torch.zeros(4, dtype=torch.bool))
