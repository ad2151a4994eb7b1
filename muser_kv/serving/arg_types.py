"""The command-line int types every muser-kv command shares: a flag's value
refused by the parser, naming the bound, before anything runs."""

from __future__ import annotations

import argparse
from typing import Callable


def at_least(minimum: int) -> Callable[[str], int]:
    """An ``argparse`` type: an int of at least ``minimum``."""
    want = "a positive int" if minimum == 1 else f"an int >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {want}, got {value}")
        return value

    parse.__name__ = want
    return parse


positive = at_least(1)
non_negative = at_least(0)
