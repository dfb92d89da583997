"""What no error body may carry (the README's promise): a traceback, a file path or an
internal exception's text. Every server the suite starts records the errors it sends
(`ZEROHOP_ERROR_RECORD`, zerohop.api.http.error_record); conftest points them all at one file
and checks what each test added with `leaks`.

The patterns are precise on purpose: API messages name fields, values and limits
("max_tokens: Field required", "Expected `int`, got `str`"), never Python's own words."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

LEAK_PATTERNS = {
    "a traceback": re.compile(r"Traceback \(most recent call last\)"),
    "a traceback frame": re.compile(r"""File "[^"]*", line \d+|\bline \d+, in [\w<>]+"""),
    "a Python file": re.compile(r"\w\.pyc?\b"),
    "a host path": re.compile(r"(?<![\w.:/])/(?:work|tmp|home|root|usr|opt|var|srv|proc)/"),
    "an installed package path": re.compile(r"\b(?:site|dist)-packages\b"),
    "a Python class": re.compile(r"<class '[\w.]+'>"),
    "an exception class name": re.compile(
        r"\b[A-Z][A-Za-z]*(?:Error|Exception|Interrupt|Iteration|Exit)\b"
    ),
    "an OS error's text": re.compile(r"\[Errno -?\d+\]"),
}


def leaks(text: str) -> list[str]:
    """What in `text` (and in every string of the JSON it holds) should not be there."""
    found = []
    for piece in _texts(text):
        found += [what for what, pattern in LEAK_PATTERNS.items() if pattern.search(piece)]
    return sorted(set(found))


def _texts(text: str) -> Iterator[str]:
    """The raw text, and the strings of the JSON in it (a body, or an SSE chunk's data
    lines): JSON escapes the quotes and slashes of a traceback."""
    yield text
    candidates = [text, *(line[5:] for line in text.splitlines() if line.startswith("data:"))]
    for candidate in candidates:
        try:
            yield from _strings(json.loads(candidate))
        except ValueError:
            continue


def _strings(value: object) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def read_records(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """The records written since `offset`, and the offset after them (whole lines only)."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    return [json.loads(line) for line in complete.splitlines()], offset + len(complete)


def offenders(records: Iterable[dict]) -> list[str]:
    """One line per record that leaks, saying where, what and the start of the body."""
    found = []
    for record in records:
        if what := leaks(record["body"]):
            where = f"{record['surface']} {record['where']} -> {record['status']}"
            found.append(f"{where}: {', '.join(what)}: {record['body'][:300]!r}")
    return found


class ErrorRecord:
    """The file every server of this session records its error responses in (inherited
    through the environment: LiveServer, other subprocesses, in-process servers), and how
    far it has been checked."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.checked = 0

    def check(self, when: str) -> None:
        """Fail, listing them, if the records written since the last check leak internals."""
        records, self.checked = read_records(self.path, self.checked)
        if bad := offenders(records):
            lines = "\n  ".join(bad)
            pytest.fail(f"error bodies sent {when} carry internals:\n  {lines}", pytrace=False)
