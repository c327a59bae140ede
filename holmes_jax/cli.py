"""What every command-line entry point shares: bad input ends in one `error:` line and exit 2."""

from __future__ import annotations

import argparse
import sys
from typing import Callable, NoReturn

from holmes_jax.config import ConfigError


def fail(message: str) -> NoReturn:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """argparse for our commands: a bad flag is one `error:` line and status 2 (through `run`),
    not argparse's usage dump."""

    def error(self, message):
        raise ConfigError(message)


def positive_int(text: str) -> int:
    """An argparse `type` for positive integer flags."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a positive integer")
    return int(text)


def run(main: Callable[[list[str]], int | None], argv: list[str] | None = None) -> NoReturn:
    """Runs `main(argv)`, turning `ConfigError` into `error: ...` on stderr and exit status 2."""
    try:
        code = main(sys.argv[1:] if argv is None else argv)
    except ConfigError as e:
        fail(str(e))
    raise SystemExit(code or 0)


def non_negative_int(text: str) -> int:
    """An argparse `type` for integer flags that may be 0."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: a non-negative integer")
    return int(text)
