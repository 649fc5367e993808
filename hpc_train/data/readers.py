"""Documents out of input files, streamed in batches so that memory does not grow with the corpus: parquet
and JSON lines through pyarrow (its streaming readers), a plain text file as one document.

A document is (prompt, text): a record with a text column/key is a document without prompt; a record with
`prompt` and `response` strings is an instruction example (the loss counts the response only)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path

from hpc_train.config import ConfigError

Document = tuple[str | None, str]
Where = tuple[str, dict]  # where a record is (file:line, file row N) and its fields, for an error
BATCH_DOCS = 1024  # documents per batch: what one tokenizer task takes
JSON_BLOCK = 1 << 24  # bytes pyarrow parses at a time; a JSON line must fit in one


def iter_documents(path: Path, text_key: str = "text", batch_docs: int = BATCH_DOCS) -> Iterator[list[Document]]:
    """`path`'s documents, `batch_docs` at a time: .parquet and .jsonl/.ndjson by record, any other file whole."""
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        yield from _parquet(path, text_key, batch_docs)
    elif suffix in (".jsonl", ".ndjson"):
        yield from _json_lines(path, text_key)
    else:
        yield [(None, read_text_input(path))]


def _parquet(path: Path, text_key: str, batch_docs: int) -> Iterator[list[Document]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as err:
        raise ConfigError(f"input {path} is not a readable parquet file: {err}") from None
    fields = {f.name: f.type for f in file.schema_arrow}
    columns = [c for c in (text_key, "prompt", "response") if c in fields]
    if text_key not in fields and not {"prompt", "response"} <= fields.keys():
        raise ConfigError(f"input {path} has columns {sorted(fields)}: it needs a '{text_key}' column (--text-key "
                          "names another) or 'prompt' and 'response' columns")  # fmt: skip
    if bad := [c for c in columns if not (pa.types.is_string(fields[c]) or pa.types.is_large_string(fields[c]))]:
        raise ConfigError(f"input {path}: column(s) {bad} are not strings ({[str(fields[c]) for c in bad]})")
    first = 0
    for batch in file.iter_batches(batch_size=batch_docs, columns=columns):
        yield _documents(batch.to_pydict(), text_key, first, lambda n: (f"{path} row {n}", {}))
        first += batch.num_rows


def _json_lines(path: Path, text_key: str) -> Iterator[list[Document]]:
    import pyarrow as pa
    import pyarrow.json as pj

    schema = pa.schema([(c, pa.string()) for c in dict.fromkeys((text_key, "prompt", "response"))])
    options = pj.ParseOptions(explicit_schema=schema, unexpected_field_behavior="ignore")
    first = 0
    try:
        for batch in pj.open_json(path, read_options=pj.ReadOptions(block_size=JSON_BLOCK), parse_options=options):
            yield _documents(batch.to_pydict(), text_key, first, lambda n: _json_record(path, n))
            first += batch.num_rows
    except pa.ArrowInvalid as err:
        raise ConfigError(f"{path} is not JSON lines of {{\"{text_key}\": ...}} or {{\"prompt\": ..., \"response\": "
                          f"...}} strings (after record {first}): {err}") from None  # fmt: skip


def _documents(columns: dict[str, list], text_key: str, first: int, where: Callable[[int], Where]) -> list[Document]:
    """The records of one batch as documents; records are numbered from 1 in the file, and `where(n)` says
    where record n is and what it holds, for the error a record without text gets."""
    texts, prompts, responses = (columns.get(c) for c in (text_key, "prompt", "response"))
    n = len(next(iter(columns.values())))
    out: list[Document] = []
    for i in range(n):
        if texts is not None and texts[i] is not None:
            out.append((None, texts[i]))
        elif prompts is not None and responses is not None and None not in (prompts[i], responses[i]):
            out.append((prompts[i], responses[i]))
        else:
            raise ConfigError(_no_text(text_key, *where(first + i + 1)))
    return out


def _no_text(text_key: str, place: str, record: dict) -> str:
    """A record holds neither text nor an instruction example: where, and, if it holds strings under other
    keys, the --text-key that reads one of them."""
    others = [k for k, v in record.items() if isinstance(v, str) and k not in (text_key, "prompt", "response")]
    problem = f'{place} has no "{text_key}" string, nor "prompt" and "response" strings'
    if len(others) == 1:
        return f'{problem}: to read its text from "{others[0]}", give --text-key {others[0]}'
    if others:
        return f"{problem}: give --text-key KEY to read its text from another key (it has {', '.join(others)})"
    return problem


def _json_record(path: Path, number: int) -> Where:
    """Record `number` (from 1) of a JSON-lines file, as pyarrow counts them (blank lines skipped): its line
    and its fields (none when it is not a JSON object). Read again only for an error."""
    with open(path, encoding="utf-8", errors="replace") as f:
        records = ((i, line) for i, line in enumerate(f, 1) if line.strip())
        line_no, line = next(itertools.islice(records, number - 1, None), (number, "{}"))
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        record = {}
    return f"{path}:{line_no}", record if isinstance(record, dict) else {}


def read_text_input(path: Path) -> str:
    """A text file's contents; binary input (NUL bytes or invalid UTF-8) is refused by name."""
    data = path.read_bytes()
    if b"\0" in data:
        raise ConfigError(f"input {path} is binary (it holds NUL bytes); prepare-data takes text files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"input {path} is not UTF-8 text (byte {err.start}); convert it or leave it out") from None
