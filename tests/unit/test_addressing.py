"""Cache addressing is a pure function of a prompt's segments and what names an index's caches: no model,
no store, no files."""

from __future__ import annotations

from rag_kvcache.engine.prompt import Segment
from rag_kvcache.store.addressing import CacheAddressing, address, cache_key

PREFIX, SEP = (1, 2), (9,)
A, B, C = (10, 11, 12), (20, 21), (30, 31, 32)
Q = Segment((5, 6), False, "question")


def addressing(neighbours=None) -> CacheAddressing:
    return CacheAddressing("ns", PREFIX, PREFIX, SEP, neighbours or {})


def chunk(ids) -> Segment:
    return Segment(ids, True, "chunk")


def test_the_prefix_is_read_behind_nothing_and_chunks_behind_it():
    at = addressing()
    prefix, a, sep, b, q = address(at, [Segment(PREFIX, True, "prefix"), chunk(A), Segment(SEP, False), chunk(B), Q])
    assert prefix.keys == (cache_key("ns", (), PREFIX),) and prefix.context == () and not prefix.counted
    assert a.keys == (cache_key("ns", PREFIX, A),) and a.context == PREFIX and a.counted and not a.request_text
    assert b.keys == (at.key(B),) and b.contexts == (PREFIX,)
    assert sep.keys == q.keys == ()  # computed at query time


def test_a_chunk_reads_its_neighbour_cache_and_the_prefix_one_unless_the_prompt_reproduces_one():
    at = addressing({addressing().neighbour_key(B): [A]})
    one = at.neighbour_context([A])  # PREFIX + A + SEP
    exact = address(at, [Segment(PREFIX, True), chunk(A), Segment(SEP, False), chunk(B), Q])[3]
    assert exact.contexts == (one,) and exact.keys == (at.key(B, one),)  # the prompt is that context: it alone
    blended = address(at, [Segment(PREFIX, True), chunk(C), Segment(SEP, False), chunk(B), Q])[3]
    assert blended.contexts == (one, PREFIX) and blended.keys == (at.key(B, one), at.key(B, PREFIX))
    assert exact.context == one and blended.context is None  # a mean is exact behind no prompt
    first = address(at, [Segment(PREFIX, True), chunk(B), Q])[1]
    assert first.contexts == (PREFIX,)  # depth 0: the behind-prefix cache is exact there


def test_without_depths_a_chunk_has_one_neighbour_cache_read_at_every_depth_after_the_first():
    """`cached_neighbours` (`by_depth=False`): one cache behind all the recorded neighbours, read with the
    behind-prefix one wherever chunks come before the chunk; by depth (`neighbours`), behind as many as it meets."""
    near = {addressing().neighbour_key(C): [A, B]}
    deep = CacheAddressing("ns", PREFIX, PREFIX, SEP, near, by_depth=False)
    both = deep.neighbour_context([A, B])  # PREFIX + B + SEP + A + SEP: the most similar last
    assert deep.neighbour_sets([A, B]) == [[A, B]] and deep.neighbour_contexts([A, B]) == [both]
    assert deep.neighbour_sets([]) == [] and deep.contexts_at(3, B) == (PREFIX,)  # no neighbours recorded
    assert deep.contexts_at(0, C) == (PREFIX,)
    assert deep.contexts_at(1, C) == deep.contexts_at(4, C) == (both, PREFIX)
    by_depth = addressing(near)
    assert by_depth.neighbour_sets([A, B]) == [[A], [A, B]]
    assert by_depth.contexts_at(1, C) == (by_depth.neighbour_context([A]), PREFIX)
    assert by_depth.contexts_at(4, C) == (both, PREFIX)


def test_stored_means_are_one_read_under_a_key_of_their_own_and_cached_contexts_are_never_exact():
    """`cached_neighbours` since session 40 (`stored_means`): a chunk after the first reads one cache, the mean
    of its neighbour cache and behind-prefix one, under a key no cache behind one context has. Its neighbour
    cache, computed behind cached K/V, is no prefill behind their text: a prompt laid out as that context still
    reads the mean, inexact (an index stored before, the two averaged)."""
    near = {addressing().neighbour_key(C): [A, B]}
    means = CacheAddressing("ns", PREFIX, PREFIX, SEP, near, by_depth=False, stored_means=True)
    both = means.neighbour_context([A, B])
    assert means.neighbour_reads(C) == ((means.mean_key(C, (both, PREFIX)), (both, PREFIX)),)
    assert means.mean_key(C, (both, PREFIX)) not in {
        means.key(C, both),
        means.key(C, PREFIX),
        means.key(C, both + PREFIX),
    }
    assert means.mean_key(C, (both, PREFIX)) != means.mean_key(C, (both + PREFIX,))  # the contexts stay apart
    laid_out = [Segment(PREFIX, True), chunk(B), Segment(SEP, False), chunk(A), Segment(SEP, False), chunk(C), Q]
    assert PREFIX + B + SEP + A + SEP == both  # the prompt before C is its neighbour context
    for stored_means in (True, False):
        at = CacheAddressing("ns", PREFIX, PREFIX, SEP, near, by_depth=False, stored_means=stored_means)
        c = address(at, laid_out)[5]
        assert c.contexts == (both, PREFIX) and c.context is None and not at.prefilled(C, both)
        assert c.keys == ((at.mean_key(C, (both, PREFIX)),) if stored_means else (at.key(C, both), at.key(C, PREFIX)))
        assert at.prefilled(C, PREFIX) and at.prefilled(A, PREFIX)
    assert addressing(near).prefilled(C, both)  # `neighbours`: computed behind their text


def test_a_run_of_a_stored_sequence_reads_its_cache_behind_the_tokens_before_the_run():
    run = Segment(C[1:], True, "run", whole=C, offset=1)
    prefix, part, q = address(addressing(), [Segment(PREFIX, True), run, Q])
    assert part.whole == C and part.keys == (cache_key("ns", PREFIX, C),) and part.context == PREFIX + C[:1]


def test_another_head_makes_it_and_the_first_chunk_behind_it_request_text_under_the_salt():
    at = addressing()
    head, text, a, b, q = address(
        at, [Segment((7, 8), True, "head"), Segment((3,), False), chunk(A), chunk(B), Q], salt="tenant"
    )
    assert head.request_text and head.keys == (at.key((7, 8), (), "tenant"),)
    assert a.request_text and a.contexts == ((7, 8, 3),) and a.keys == (at.key(A, (7, 8, 3), "tenant"),)
    assert not a.counted  # made by the first prompt with this head: not a missing cache
    assert not b.request_text and b.keys == (at.key(B),) and b.counted
    assert at.key(A, (7, 8, 3), "tenant") != at.key(A, (7, 8, 3), "other")
