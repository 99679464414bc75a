"""Conversation files read and checked: `{"messages": [{"role", "content"}, ...]}` records, one error line for a bad one.

A conversation source is what `data.source` names for pretraining text (a file, a folder, an `hf:`
dataset; sources.list_source lists it, and refuses what it refuses), holding JSON lines (`.jsonl`,
`.json`, `.ndjson`, plain or `.gz`, `.zst`, `.xz`, `.bz2`) or Parquet or Arrow files with a
`messages` column; or `python-stdlib-chat`, the built-in set (stdlib_chat.py).

Each record is checked as it is read; the first bad one is a ConfigError naming the file, the line
(of a Parquet or Arrow file, the row, counted from 0) and the field: a line that is not JSON, no
`messages`, a message without `role` or `content`, a role other than user, assistant or system, a
system message anywhere but first, turns that do not alternate (the user's first), no assistant
turn. A conversation's id is `path:line` (`path#row`): the split hashes it, as it hashes a
document's (split.py).
Torch, numpy: never.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Iterator

from ..config import ConfigError, DataConfig
from . import readers, sources, split, stdlib_chat
from .chat_template import ROLES

FIELD = "messages"
EXPECTED = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}, ...]}'
BATCH_ROWS = 1024  # rows of a Parquet or Arrow file read at once


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: list[dict]


def list_conversations(source: str) -> sources.Source:
    """The source's files (a ConfigError naming a text file among them: it holds no conversations)."""
    if source == stdlib_chat.NAME:
        return stdlib_chat.listing()
    listed = sources.list_source(DataConfig(source=source))
    for f in listed.files:
        if f.kind == "text":
            raise ConfigError(f"{f.path}: a text file, no conversations; expected JSON lines of {EXPECTED} "
                              f"(.jsonl, .json, .ndjson, also compressed), or Parquet or Arrow with a column "
                              f"{FIELD!r}")
    return listed


def read_split(source: str, val_fraction: float) -> Iterator[tuple[str, Conversation]]:
    """("train" or "val", conversation) for each conversation of `source`, in file order. The
    built-in set's sides are its split's (stdlib_chat.py); a file's by each conversation's id."""
    if source == stdlib_chat.NAME:
        for side, messages_of in (("train", stdlib_chat.conversations), ("val", stdlib_chat.held_out)):
            for i, messages in enumerate(messages_of(val_fraction)):
                yield side, Conversation(f"{stdlib_chat.NAME}#{side}{i}", messages)
        return
    selection = split.Selection(1.0, val_fraction)
    for conv in read_conversations(list_conversations(source)):
        yield ("val" if selection.is_val(conv.id) else "train"), conv


def read_conversations(listed: sources.Source) -> Iterator[Conversation]:
    for f in listed.files:
        if f.kind == "jsonl":
            yield from _jsonl(f)
        else:
            yield from _table(f)


def check_messages(messages: object, where: str) -> list[dict]:
    """`messages` as a conversation, or a ConfigError naming `where` and the field at fault."""
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else _a(messages)
        raise ConfigError(f"{where}: {FIELD!r} is {what}; expected a list of {{\"role\", \"content\"}} objects")
    expected = "user"
    for i, m in enumerate(messages):
        field = f"{FIELD}[{i}]"
        if not isinstance(m, dict):
            raise ConfigError(f"{where}: {field} is {_a(m)}; expected an object with \"role\" and "
                              "\"content\"")
        for key in ("role", "content"):
            if key not in m:
                raise ConfigError(f"{where}: {field} has no {key!r}; expected an object with \"role\" and \"content\"")
        role, content = m["role"], m["content"]
        if role not in ROLES:
            raise ConfigError(f"{where}: {field}.role = {_shown(role)}; expected user, assistant or system")
        if not isinstance(content, str):
            raise ConfigError(f"{where}: {field}.content is {_a(content)}; expected a string")
        if role == "system" and i > 0:
            raise ConfigError(f"{where}: {field}.role = 'system' after the first message; a system message comes "
                              "first, once")
        if role != "system" and role != expected:
            raise ConfigError(f"{where}: {field}.role = {role!r} where the {expected}'s turn was expected (turns "
                              "alternate, the user's first)")
        if role != "system":
            expected = "assistant" if role == "user" else "user"
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: {FIELD!r} has no assistant turn; a conversation to learn from has one or more")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _a(value: object) -> str:
    """A JSON value's kind, as a noun with its article."""
    kind = {dict: "object", list: "list", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)
    return ("an " if kind[0] in "aeiou" else "a ") + kind


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _jsonl(f: sources.SourceFile) -> Iterator[Conversation]:
    with readers.damaged_as_config_error(f), readers.open_binary(f.path, f.compression) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            where = f"{f.path}:{number}"
            record = _record(line, where)
            if not isinstance(record, dict) or FIELD not in record:
                raise ConfigError(f"{where}: no field {FIELD!r}; expected {EXPECTED}")
            yield Conversation(f"{f.rel}:{number}", check_messages(record[FIELD], where))


def _record(line: bytes, where: str) -> object:
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        cut = "" if line.endswith(b"\n") else ", and the file ends inside it: truncated?"
        raise ConfigError(f"{where}: not valid JSON ({e.msg}){cut}; expected {EXPECTED}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not UTF-8 text; expected {EXPECTED}") from None
    except (RecursionError, ValueError):  # nested past the stack; an integer of too many digits
        raise ConfigError(f"{where}: not readable as JSON (nested too deeply, or a number too long); expected "
                          f"{EXPECTED}") from None


def _table(f: sources.SourceFile) -> Iterator[Conversation]:
    """A Parquet or Arrow file's `messages` column, a record batch at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if f.kind == "parquet":
            pf = pq.ParquetFile(f.path)
            names = pf.schema_arrow.names
            batches = pf.iter_batches(batch_size=BATCH_ROWS, columns=[FIELD] if FIELD in names else [])
        else:
            names, batches = _arrow_batches(pa, f)
        if FIELD not in names:
            raise ConfigError(f"{f.path}: no column {FIELD!r}; it has {', '.join(names) or 'none'}; expected a "
                              f"column {FIELD!r} of lists of {{\"role\", \"content\"}}")
        row = 0
        for batch in batches:
            for messages in batch.column(batch.schema.get_field_index(FIELD)).to_pylist():
                yield Conversation(f"{f.rel}#{row}", check_messages(messages, f"{f.path}: row {row}"))
                row += 1
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:
            raise
        raise ConfigError(f"{f.path}: unreadable {f.kind.capitalize()} file ({e})") from None


def _arrow_batches(pa, f: sources.SourceFile):
    """(column names, record batches) of an Arrow IPC file, the stream format (save_to_disk's) or the file format."""
    source = pa.memory_map(str(f.path))
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema.names, reader
    except pa.ArrowInvalid:
        source.seek(0)
        file_reader = pa.ipc.open_file(source)
        return file_reader.schema.names, (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
