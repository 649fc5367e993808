"""A config field's rule, declared beside the field (`choice`, `positive`, `non_negative`, `fraction`), and the
error every broken rule becomes. Core sections (schema.py) and every feature's options (features/) declare
their fields with these, and config/checks.py applies them all."""

from __future__ import annotations

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
    """A configuration problem, with a message that names the key and what to change."""
