"""A config field's rule, declared beside the field (`choice`, `positive`, `non_negative`, `fraction`), and the
error every broken rule becomes. Core sections (schema.py) and every feature's options (features/) declare
their fields with these, and config/checks.py applies them all."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import field
from typing import Any

from hpc_train.errors import UserError

RANGES = {  # a field's `range` rule -> (test, what the message says it must be)
    "positive": (lambda v: v > 0, "> 0"),
    "non_negative": (lambda v: v >= 0, ">= 0"),
    "fraction": (lambda v: 0 <= v < 1, "in [0, 1), e.g. 0.9 or 0.95"),
}


def choice(*options: str) -> Any:
    """A field that takes one of `options`; the first is its default."""
    return field(default=options[0], metadata={"choices": options})


def positive(default: float | None) -> Any:
    return field(default=default, metadata={"range": "positive"})


def non_negative(default: float | None) -> Any:
    return field(default=default, metadata={"range": "non_negative"})


def fraction(default: float) -> Any:
    return field(default=default, metadata={"range": "fraction"})


class ConfigError(UserError, ValueError):
    """A configuration problem, with a message that names the key and what to change, one line per problem.
    `layout`: those lines that are a layout's problems at some world size (LayoutError's), beside which a
    command names where it took that world size from (`noting_layout`), and beside no other line."""

    def __init__(self, message: str, layout: Iterable[str] = ()):
        super().__init__(message)
        self.layout = tuple(layout)

    def noting_layout(self, note: str) -> ConfigError:
        """This error with `note` after each line of a layout problem."""
        lines = [f"{line} {note}" if line in self.layout else line for line in str(self).splitlines()]
        return ConfigError("\n".join(lines))


class LayoutError(ConfigError):
    """A problem of the parallel layout that the world size it was checked at decides (a world size that
    tp x pp x cp does not divide, a global batch from the dp it gives)."""

    def __init__(self, message: str):
        super().__init__(message, message.splitlines())
