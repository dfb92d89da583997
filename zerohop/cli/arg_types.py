"""argparse types for the numeric flags of `zerohop serve` and `generate`, and a parser whose
usage errors are one line.

Each type refuses a value out of range as argparse reads it, so `zerohop serve
--max-num-seqs 0` ends at once (exit 2) with one line naming the flag, before any model is
loaded: "zerohop serve: error: argument --max-num-seqs: must be an integer >= 1, not '0'".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import NoReturn, TypeAlias


class OneLineParser(argparse.ArgumentParser):
    """A usage error is one line (the cause and where to read the usage), not the usage
    block; its subcommands' parsers are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def integer(minimum: int, maximum: int | None = None) -> Callable[[str], int]:
    """An integer flag in [minimum, maximum] ("1_000" is 1000)."""
    span = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"

    def parse(text: str) -> int:
        try:
            value = int(text.replace("_", ""))
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be an integer {span}, not {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def number(minimum: float, *, above: bool = False) -> Callable[[str], float]:
    """A finite number flag >= minimum (> minimum with `above`)."""
    span = f"{'>' if above else '>='} {minimum:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        low = value <= minimum if above else value < minimum
        if not math.isfinite(value) or low:
            raise argparse.ArgumentTypeError(f"must be a finite number {span}, not {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def share(text: str) -> float:
    """A fraction in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:  # NaN fails this too
        raise argparse.ArgumentTypeError(f"must be a number above 0 and at most 1, not {text!r}")
    return value


POSITIVE_INT = integer(1)
NONNEGATIVE_INT = integer(0)
PORT = integer(0, 65535)
NONNEGATIVE_NUMBER = number(0.0)  # >= 0
POSITIVE_NUMBER = number(0.0, above=True)
SHARE = share
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")  # tools/parsers.py


# The subcommands of `zerohop` (each command module adds its own parser to them).
Subcommands: TypeAlias = "argparse._SubParsersAction[OneLineParser]"
