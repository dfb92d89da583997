"""What both `zerohop keys` command lines share: the limit flags and the argument parsers.

`add_limit_flags` makes the flags of every limit (`identity.LIMIT_FIELDS`: --rpm, --itpm,
--otpm, --max-concurrency, each an integer >= 0, 0 allowing nothing; "1_000" is read as
1000) and --budget (tokens > 0), for `zerohop keys create/update/tenant` (`keys_cli`) and
`zerohop keys sign` (`keys_cli_signed`), whose tenant limits are the same flags prefixed
with "tenant-". Every value is checked by `zerohop.gateway.keys.validation` as argparse reads
it: a bad one is a one-line usage error naming its flag (exit 2).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from zerohop.gateway.keys import validation
from zerohop.gateway.keys.identity import BUDGET_PERIODS, LIMIT_FIELDS, Budget

BUDGET_METAVAR = "N[/day|/month]"
BUDGET_HELP = "token budget: 5000/day, 1000000/month, or 5000 (in total)"

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(w|d|h|m|s)", re.IGNORECASE)
_UNIT_SECONDS = {"w": 604800, "d": 86400, "h": 3600, "m": 60, "s": 1}


def parse_duration_or_time(text: str, *, now: float | None = None) -> float:
    """Unix seconds: now + a duration ("30d", "12h", "1d12h", "90m", "2w", "45s") or an
    ISO-8601 time ("2026-01-31", "2026-01-31T12:00:00Z"; no offset means UTC)."""
    s = text.strip()
    now = time.time() if now is None else now
    if s and _DURATION.sub("", s).strip() == "" and s[0].isdigit():
        return now + sum(float(n) * _UNIT_SECONDS[u.lower()] for n, u in _DURATION.findall(s))
    try:
        t = datetime.fromisoformat(s)
    except ValueError:
        raise ValueError(
            f"{text!r} is neither a duration (30d, 12h, 90m, 2w) nor an ISO-8601 time"
        ) from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=UTC)
    return t.timestamp()


_BUDGET = re.compile(r"\s*(\d[\d_]*)\s*(?:/\s*([a-z]+))?\s*", re.IGNORECASE)


def parse_budget(text: str) -> Budget:
    """A token budget: "5000/day", "1000000/month", "1_000_000/month", "5000" (total)."""
    m = _BUDGET.fullmatch(text)
    if not m or m.group(1).endswith("_"):
        raise ValueError(f"budget {text!r}: expected TOKENS, TOKENS/day or TOKENS/month")
    period = (m.group(2) or "total").lower()
    if period not in BUDGET_PERIODS:
        raise ValueError(f"budget {text!r}: period must be one of {', '.join(BUDGET_PERIODS)}")
    tokens = validation.budget_tokens(int(m.group(1).replace("_", "")), f"budget {text!r}: tokens")
    return Budget(tokens, period)


NO_BUDGET = "none"  # `zerohop keys --budget none`: remove the budget


def parse_budget_or_none(text: str) -> Budget | str:
    """A budget, or NO_BUDGET for "none" (also "off")."""
    return NO_BUDGET if text.strip().lower() in ("none", "off") else parse_budget(text)


def parse_weight(text: str) -> float:
    """A fair-share weight on the command line: a finite number > 0."""
    try:
        value: object = float(text)
    except ValueError:
        value = text
    return validation.weight(value, "the weight")


def parse_limit(text: str) -> int:
    """A limit's value on the command line: an integer >= 0 ("1_000" is 1000)."""
    value: int | str
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        value = text  # refused below, with the same message as a negative number
    return validation.nonnegative_int(value, "a limit")


def argtype(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type: its ValueError becomes the usage error's message."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = parse.__name__
    return convert


def add_limit_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    *,
    prefix: str = "",
    budget: Callable[[str], Any] | None = None,
    budget_help: str = BUDGET_HELP,
) -> None:
    """--PREFIXrpm ... --PREFIXmax-concurrency (into `args.PREFIXrpm`..., "-" as "_") and
    --PREFIXbudget, parsed by `budget` (default: parse_budget; `zerohop keys` takes
    parse_budget_or_none, where "none" removes the budget)."""
    limit = argtype(parse_limit)
    for spec in LIMIT_FIELDS:
        parser.add_argument(f"--{prefix}{spec.flag}", type=limit, metavar="N", help=spec.help)
    parser.add_argument(
        f"--{prefix}budget",
        type=budget or argtype(parse_budget),
        metavar=BUDGET_METAVAR,
        help=budget_help,
    )
