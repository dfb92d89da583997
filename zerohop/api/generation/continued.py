"""The thought tokens of a continued answer (`continue_token_ids`, a client's failover), so
that the continuing replica's usage counts them as an uninterrupted run would have: the
caller has them, and the first replica never reported its usage."""

from __future__ import annotations

from collections.abc import Callable

from zerohop.api.conversation.events import OutputReader
from zerohop.api.generation.driver import Generation


def continued_thought_tokens(generation: Generation) -> int:
    """`thought_tokens` of the generation's continued tokens (0 when nothing is continued or
    no thought is read)."""
    continues, factory = generation.request.continues, generation.request.readers
    reader = generation.readers.get(0)
    if not continues or factory is None or reader is None or reader.thoughts is None:
        return 0
    if not reader.thought_ended:
        return len(continues)
    skip = generation.request.params.skip_special_tokens
    decode = generation.ctx.tokenizer.decode
    return thought_tokens(lambda ids: decode(ids, skip_special_tokens=skip), continues, factory)


def thought_tokens(
    decode: Callable[[list[int]], str], tokens: list[int], reader: Callable[[], OutputReader]
) -> int:
    """How many of `tokens` an uninterrupted run counts as thought: each token read while
    the thought was still open (driver.py counts a step's tokens before reading it, one token
    a step), so those up to the one that ended the thought: the shortest prefix whose text
    ends it, found by halving (all of them when none does)."""

    def ends_thought(count: int) -> bool:
        probe = reader()
        probe.feed(decode(tokens[:count]).rstrip("\ufffd"))
        return probe.thoughts is None or probe.thought_ended

    low, high = 0, len(tokens)
    if not ends_thought(high):
        return high
    while low < high:
        middle = (low + high) // 2
        if ends_thought(middle):
            high = middle
        else:
            low = middle + 1
    return low
