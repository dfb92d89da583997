"""Choosing a replica: prefix affinity by rendezvous hashing, bounded by load.

Requests that share a prompt prefix (a system prompt, a conversation so far) should land on
the replica whose prefix cache holds it. Rendezvous (highest-random-weight) hashing ranks the
replicas for each prefix: every client ranks them the same way without coordinating, and
when a replica leaves, only the prefixes it ranked first move. The key is the prompt's first
`prefix_chars` characters, cut down to a multiple of `block_chars` (about one KV block of
text), so prompts that differ only after their shared part hash alike.

The key is the conversation's opening (see `surfaces.Surface.affinity_text`): the system
prompt and first user turn, which every later turn of the conversation starts with.

Load bounds where a new prefix goes: when the preferred replica reports a queue wait more
than `wait_ratio` times the least-loaded healthy replica's plus `wait_slack_ms` (waits that
are all high together are no reason to move), or has `in_flight_slack` more of this client's
requests in flight, the less loaded of two candidates is taken (the preferred one and another
at random: power of two choices), which bounds the imbalance without giving up affinity while
loads are close.

A prefix this client already sent somewhere stays there (the last `remember` keys), as long
as that replica is usable: it holds the prefix in its cache, and moving costs a whole prefill
of it elsewhere (seconds on a CPU for a long system prompt; `benchmarks/affinity.py` measured
moved turns costing more than the queue they avoided). So load spreads new conversations,
and a conversation that load placed off its preferred replica keeps to where it was placed.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from zerohop.client.replica import Replica


@dataclass(slots=True)
class AffinityPolicy:
    prefix_chars: int = 2048
    block_chars: int = 64
    wait_slack_ms: float = 1000.0
    wait_ratio: float = 2.0
    in_flight_slack: int = 4
    remember: int = 65536  # prefixes whose replica is kept (least recently used forgotten)
    placed: OrderedDict[bytes, str] = field(default_factory=OrderedDict, repr=False)

    def key(self, prompt: str) -> bytes:
        cut = min(len(prompt), self.prefix_chars)
        cut -= cut % self.block_chars
        return prompt[: cut or len(prompt)].encode()

    def choose(
        self, prompt: str, replicas: Sequence[Replica], rng: random.Random | None = None
    ) -> tuple[Replica, bool]:
        """The replica for `prompt`, and whether affinity chose it (False: load did)."""
        usable = [r for r in replicas if r.usable]
        if not usable:
            raise LookupError("no replica is available (all are down or unknown)")
        key = self.key(prompt)
        where = self.placed.get(key)
        chosen = next((r for r in usable if r.url == where), None)
        by_affinity = True
        if chosen is None:
            chosen, by_affinity = self._place(key, usable, rng.choice if rng else random.choice)
        self.placed[key] = chosen.url
        self.placed.move_to_end(key)
        if len(self.placed) > self.remember:
            self.placed.popitem(last=False)
        return chosen, by_affinity

    def _place(
        self, key: bytes, usable: Sequence[Replica], choice: Callable[[Sequence[Replica]], Replica]
    ) -> tuple[Replica, bool]:
        """A new prefix: its rendezvous-preferred replica, unless load says otherwise."""
        ranked = rank(key, usable)
        preferred = ranked[0]
        if len(ranked) == 1 or not self._overloaded(preferred, ranked):
            return preferred, True
        other = choice(ranked[1:])
        return (other, False) if _load(other) < _load(preferred) else (preferred, True)

    def _overloaded(self, replica: Replica, replicas: Sequence[Replica]) -> bool:
        least_wait = min(r.queue_wait_ms for r in replicas)
        least_in_flight = min(r.in_flight for r in replicas)
        return (
            replica.queue_wait_ms > least_wait * self.wait_ratio + self.wait_slack_ms
            or replica.in_flight > least_in_flight + self.in_flight_slack
        )


def rank(key: bytes, replicas: Sequence[Replica]) -> list[Replica]:
    """Replicas from the most to the least preferred for `key` (rendezvous hashing)."""
    return sorted(replicas, key=lambda r: _weight(key, r.url), reverse=True)


def _weight(key: bytes, url: str) -> int:
    digest = hashlib.blake2b(key + b"\0" + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _load(replica: Replica) -> tuple[float, int]:
    return replica.queue_wait_ms, replica.in_flight


class RoundRobinPolicy:
    """Each request to the next usable replica in turn, whatever its prompt: the baseline
    that prefix affinity is measured against (`benchmarks/affinity.py`)."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(
        self, prompt: str, replicas: Sequence[Replica], rng: random.Random | None = None
    ) -> tuple[Replica, bool]:
        usable = sorted((r for r in replicas if r.usable), key=lambda r: r.url)
        if not usable:
            raise LookupError("no replica is available (all are down or unknown)")
        return usable[next(self._turn) % len(usable)], False
