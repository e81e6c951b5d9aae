"""A chat longer than its prompt may be, shortened: its oldest turns after the system's dropped in one step, so
that the turns that follow extend the same shortened prompt and read it from the conversation cache until it
fills the limit again, instead of each dropping one more message and computing everything.

`ChatFit.fitted` lays a chat out within a token limit, keeping a cut the conversation cache holds while it fits;
`ChatFit.cut_ahead` finds, after an answer, the cut the next turn will need, so that its K/V can be computed
before that turn comes (`FusedGenerator.prepare_fit`). Either keeps the system's turns and the last turn, and
starts the kept part with a user turn.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..config import FusionConfig
from ..engine.prompt import ChatTurn, Segment
from ..retrieval.records import ChunkRecord
from ..store.conversations import ConversationCache
from .answers import PromptTooLongError
from .layout import PromptLayout, n_tokens, prompt_ids, system_turns

log = logging.getLogger(__name__)


class ChatFit:
    """Shortens the chats `layout` lays out, keeping the cuts `conversations` holds (None: no conversation
    cache, so no cut is held)."""

    def __init__(self, layout: PromptLayout, conversations: ConversationCache | None) -> None:
        self.layout, self.conversations = layout, conversations

    def fitted(
        self,
        turns: Sequence[ChatTurn],
        chunks: Sequence[ChunkRecord],
        fusion: FusionConfig | None,
        limit: int,
        salt: str = "",
    ) -> tuple[list[Segment], int]:
        """`PromptLayout.chat_segments` of a chat whose prompt must hold at most `limit` tokens. One that holds
        more drops its oldest turns after the system's in one step, until what is left before the last turn
        fills at most half of what that turn leaves of the limit (the kept part starts with a user turn; the
        last turn, with its chunks, always stays), so that the next turns extend the same shortened prompt and
        read it from the conversation cache until it fills the limit again, instead of each dropping one more
        message and computing everything. A cut the conversation cache holds (`salt`'s: an earlier turn of this chat was
        cut there, or `prepare_fit` prepared it) is kept while it fits. Returns the segments and how many turns
        were dropped; a chat that does not fit with only its system turns and last turn raises
        `PromptTooLongError`."""
        segments = self.layout.chat_segments(turns, chunks, fusion)
        if n_tokens(segments) <= limit:
            return segments, 0
        last = n_tokens(segments) - len(self.layout.next_head(turns[:-1]))  # the last turn, its chunks and template
        system = system_turns(turns)
        fitting: list[tuple[int, list[Segment]]] = []  # (turns dropped, segments), fewest dropped first
        for c in range(1, len(turns) - system):
            if turns[system + c].role != "user":
                continue
            shorter = self.layout.chat_segments([*turns[:system], *turns[system + c :]], chunks, fusion)
            if n_tokens(shorter) <= limit:
                fitting.append((c, shorter))
                if 2 * (n_tokens(shorter) - last) <= limit - last:
                    break
        if not fitting:
            raise PromptTooLongError(
                f"the chat's prompt has {n_tokens(segments)} tokens, over the {limit} allowed, "
                "even with only its system messages and last message"
            )

        def held(candidate: tuple[int, list[Segment]]) -> int:  # tokens read from the cache, if most of the history
            ids = prompt_ids(candidate[1])
            n = 0 if self.conversations is None else self.conversations.held(salt, ids)
            return n if 2 * n >= len(ids) - last else 0  # the last turn is new: never held

        best = max(fitting, key=held)  # a cut an earlier turn made or `prepare_fit` prepared, else the half-room one
        kept = best if held(best) else fitting[-1]
        log.info(
            "the chat's prompt had %d tokens, over the %d allowed: dropped its %d oldest turns (%d tokens left)",
            n_tokens(segments),
            limit,
            kept[0],
            n_tokens(kept[1]),
        )
        return kept[1], kept[0]

    def cut_ahead(
        self, turns: Sequence[ChatTurn], fusion: FusionConfig, limit: int, n_prompt: int, dropped: int = 0
    ) -> tuple[tuple[int, ...], list[Segment], int] | None:
        """The cut the turn after `turns` will be shortened to, when it will outgrow `limit`: the chat's head
        that is kept, as token ids and as segments (the last one cut where the next message begins), and how
        many oldest turns after the system's it drops; None when there is none to prepare.

        `turns` is the chat as the client sends it, the answer just given last; the prompt just answered had
        `n_prompt` tokens and left out the `dropped` oldest turns after the system's (`fitted`). There is a cut
        when the next message, with its chunks and template, could not take twice the tokens the last one did
        (an early preparation costs one background prefill: `fitted` keeps the cut in use while it fits, and a
        later preparation of the same cut reads this one from the cache and computes only the turns after it).
        The cut is the one `fitted` keeps when the cache holds it: the fewest oldest turns dropped (the kept part
        starting with a user turn) for the chat before the next message to fill at most half of what that
        message leaves of the limit, the message taken at half the last one's size (an estimate below its
        likely size, so that the turn meets this cut before its own: `fitted` considers cuts in order up to the
        first that halves the room)."""
        if len(turns) < 2 or [t.role for t in turns[-2:]] != ["user", "assistant"]:
            return None
        system = system_turns(turns)
        now = [*turns[:system], *turns[system + dropped :]]  # the chat as the last prompt held it
        room = n_prompt - len(self.layout.next_head(now[:-2]))  # the last message, its chunks and its template
        if len(self.layout.next_head(now)) + 2 * room <= limit:
            return None
        for c in (c for c in range(dropped + 1, len(turns) - system) if turns[system + c].role == "user"):
            kept = [*turns[:system], *turns[system + c :]]
            if 2 * len(head := self.layout.next_head(kept)) <= limit - room // 2:
                break
        else:
            return None
        segments, out = self.layout.chat_segments([*kept, ChatTurn("user", ("?",))], (), fusion), list[Segment]()
        for seg in segments:  # the head's segments, the last one cut where the next message begins
            n = len(head) - n_tokens(out)
            if n <= 0:
                break
            out.append(seg if len(seg.ids) <= n else Segment(seg.ids[:n], False, seg.label))
        return head, out, c
