"""What a recorded chain head says of a log: whether the log still holds it.

The head itself is kept by the store (`zerohop.gateway.store.audit_heads`, which says where
and why); the writer records it, `zerohop audit verify` checks the log against it here.
"""

from __future__ import annotations

from zerohop.gateway.store.audit_heads import ChainHead


def check_head(head: ChainHead, last_seq: int | None, hash_at_head: str | None) -> str | None:
    """Why the log does not hold `head` (None: it does). `last_seq` is the log's last
    record's seq (None: no records); `hash_at_head` the SHA-256 of its record `head.seq`."""
    where = f"the chain head recorded at {head.describe()}"
    if last_seq is None:
        return f"{where} is missing; the log holds no records"
    if last_seq < head.seq:
        return f"{where} is missing; the log ends at record {last_seq}"
    if hash_at_head is None:
        return f"{where} is missing; the log starts after it and ends at record {last_seq}"
    if hash_at_head != head.hash:
        return f"{where} does not match record {head.seq} of the log (rewritten)"
    return None
