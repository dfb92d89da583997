"""GPT-2's byte-level alphabet: the reversible byte -> printable character table
(`bytes_to_unicode`) that byte-level BPE vocabularies spell their tokens in.

A leaf with no dependencies, so the API process can read token bytes without loading the
GGUF reader (and torch) that gguf_tokenizer.py needs.
"""

from __future__ import annotations

from functools import cache


@cache
def byte_alphabet() -> dict[int, str]:
    """Each byte's printable character (shared and cached: do not modify it)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table
