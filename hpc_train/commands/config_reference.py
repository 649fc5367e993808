"""The configuration reference, generated from the schema so it cannot drift: every key of the composed
config (the core sections and every registered feature's options), its default, its rule and the comment
the schema gives it (the comment on the field's line, or the comment lines right above it). A section's
docstring heads its table. `python -m hpc_train.commands.config_reference` prints it; docs/configuration.md is that
output, and a test fails when the two differ.

    python -m hpc_train.commands.config_reference > docs/configuration.md
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import tokenize
from typing import Any

from hpc_train.config.fields import RANGES
from hpc_train.job import JobConfig  # composed: the registered features' keys included

HEAD = """# Configuration reference

Generated from the schema by `python -m hpc_train.commands.config_reference > docs/configuration.md` (a test fails when
this page is stale). Every key can be set in the YAML config or on the command line as `section.key=value`;
`hpc-train config show CONFIG [key=value ...]` prints the resolved config and checks it. A rule is checked
before anything runs; what depends on the model family, the layout or another key is checked too, and named
in the error.
"""


def field_comments(cls: type) -> dict[str, str]:
    """Each field `cls`'s own source declares, with its comment: the one on its line, after the comment lines
    right above it."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):  # made at run time (make_dataclass): its fields come from its bases
        return {}
    comments: dict[str, str] = {}
    above: list[str] = []
    depth = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.INDENT:
            depth = token.end[1] if depth is None else depth
        if token.type == tokenize.COMMENT and token.start[1] > 0 and depth in (None, token.start[1]):  # the body's
            above.append(token.string.lstrip("#").strip())
        elif token.type == tokenize.NAME and token.start[1] == depth and token.line[depth:].startswith(token.string):
            line = token.line.strip()
            if ":" in line.split("=")[0] and not line.startswith(("def ", "@", "class ", '"""')):
                trailing = token.line.split("  # ", 1)[1].strip() if "  # " in token.line else ""
                comments[token.string] = " ".join([*above, trailing]).strip()
            above = []
        elif token.type not in (tokenize.NL, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT):
            above = [] if token.type != tokenize.NEWLINE else above
    return comments


def described(cls: type) -> dict[str, str]:
    """Every field of the dataclass `cls` (its bases' too: a composed section) with its comment."""
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            comments.update(field_comments(base))
    return comments


def rule(f: dataclasses.Field) -> str:
    if "choices" in f.metadata:
        return "one of " + ", ".join(f"`{c}`" for c in f.metadata["choices"])
    if "range" in f.metadata:
        return RANGES[f.metadata["range"]][1]
    return ""


def default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def section_rows(prefix: str, cls: type) -> tuple[list[str], list[tuple[str, type]]]:
    """The table rows of `cls`'s plain keys under `prefix`, and its nested sections (key, class)."""
    comments, rows, nested = described(cls), [], []
    for f in dataclasses.fields(cls):
        value = default_of(f)
        if dataclasses.is_dataclass(value):
            nested.append((f"{prefix}.{f.name}", type(value)))
            continue
        default = "(none)" if value is None else f"`{value!r}`" if isinstance(value, str) else f"`{value}`"
        rows.append(f"| `{prefix}.{f.name}` | {cell(default)} | {cell(rule(f))} | {cell(comments.get(f.name, ''))} |")
    return rows, nested


def render(job: type | None = None) -> str:
    """The reference of the composed config `job` (the registered features' by default)."""
    job = JobConfig if job is None else job
    out = [HEAD]
    top = [f for f in dataclasses.fields(job) if not dataclasses.is_dataclass(default_of(f))]
    out += ["## Top level", "", "| key | default | rule | what it is |", "|---|---|---|---|"]
    comments = described(job)
    out += [f"| `{f.name}` | `{default_of(f)!r}` | {cell(rule(f))} | {cell(comments.get(f.name, ''))} |" for f in top]
    pending = [(f.name, type(default_of(f))) for f in dataclasses.fields(job) if f not in top]
    while pending:
        prefix, cls = pending.pop(0)
        rows, nested = section_rows(prefix, cls)
        doc = inspect.getdoc(cls) if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}(") else ""
        out += ["", f"## `{prefix}`", ""] + ([" ".join(doc.split()), ""] if doc else [])
        out += ["| key | default | rule | what it is |", "|---|---|---|---|", *rows]
        pending = nested + pending
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
