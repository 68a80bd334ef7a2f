"""Public trace formats: read each one in its published layout into validated rows.

Formats (``workload.trace_format``, ``tiered-kv trace --format``):

* ``jsonl``: this package's own layout, one object per line with ``arrival``
  (seconds), ``output_len``, and ``prompt_tokens`` (a list), ``prompt_len``, or
  ``prompt_len`` with ``hash_ids`` and ``hash_block_size`` (prefix hashes);
  optional ``id`` and ``session`` (the requests of one session are the turns of
  one conversation, in arrival order).  Lines may come in any order (they are
  sorted by arrival).
* ``mooncake``: Mooncake's JSONL (FAST'25 traces): ``timestamp`` (milliseconds),
  ``input_length``, ``output_length``, ``hash_ids`` (one chained hash per 512
  input tokens, the last for a partial block).  It has no session ids: requests
  sharing their first two hashes are taken as one conversation (for sampling).
* ``azure``: the Azure LLM inference traces, CSV ``TIMESTAMP,ContextTokens,
  GeneratedTokens``; 2023 (code, conversation: ``2023-11-16 18:15:46.6805900``)
  and the 2024 week-long ones (``2024-05-10 00:00:00.009930+00:00``).
* ``burstgpt``: BurstGPT's CSV ``Timestamp,Model,Request tokens,Response tokens,
  Total tokens,Log Type`` (seconds; later releases add ``Session ID`` and
  ``Elapsed time``, read too).  Failed requests carry 0 response tokens.
* ``sharegpt``: the ShareGPT conversations JSON (a list of ``{"id",
  "conversations": [{"from", "value"}, ...]}``).  Every human turn is a request
  that resends the whole conversation so far; the gpt turn after it is its
  output, so the next turn really reuses it.  ShareGPT has text but neither
  token counts nor times: a turn counts one token per 4 UTF-8 bytes (at least
  one), conversations start ``1 / rate`` seconds apart and a follow-up arrives
  :data:`SHAREGPT_THINK_S` after the turn before it.

``docs/traces.md`` shows every format's columns with an example file.  A file
saved by a spreadsheet (a UTF-8 byte-order mark, CRLF line ends) reads as any
other.  The logs (``mooncake``, ``azure``, ``burstgpt``) are in time order; a
timestamp that goes backwards means a damaged or merged file and is refused,
naming both lines, both timestamps as written and how far back it goes.  A row that
cannot be read is an error naming the file, the line, the problem and the
expected columns.  A row that is well formed but cannot be replayed (zero output
tokens, as BurstGPT's failed requests; zero input tokens; an empty cell) is
skipped and *counted* under its reason in :attr:`Trace.skipped`, which
``simulate`` and ``trace inspect`` print.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from tiered_kv.errors import ConfigError
from tiered_kv.sim.files import read_text

FORMATS = ("jsonl", "mooncake", "azure", "burstgpt", "sharegpt")
MOONCAKE_BLOCK = 512  # tokens per hash id in Mooncake's traces (its README)
SHAREGPT_BYTES_PER_TOKEN = 4  # the usual rule of thumb for English BPE text
SHAREGPT_THINK_S = 10.0

_JSONL_KEYS = ("arrival", "prompt_tokens", "prompt_len", "output_len", "id", "session", "hash_ids", "hash_block_size")
_MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
_AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_BURST_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
_BURST_REQUIRED = ("Timestamp", "Request tokens", "Response tokens")
#: How each format says which conversation a request is a turn of (the sessions of ``workload.think_s``).
CONVERSATIONS = {
    "jsonl": "by its 'session' key",
    "mooncake": "by its first two hash ids (the format has no session ids)",
    "azure": "nowhere (the format has no sessions)",
    "burstgpt": "by its 'Session ID' column (later releases only)",
    "sharegpt": "by the conversation it is a turn of",
}


@dataclass(frozen=True, slots=True)
class TraceRow:
    """One validated request of a trace.

    The prompt is given one of three ways: ``prompt_tokens`` (token ids),
    ``hash_ids`` at ``hash_block_size`` tokens each (chained prefix hashes,
    covering the prompt exactly), or neither (only ``prompt_len`` is known: no
    two requests share anything).  ``output_tokens`` is set only where a later
    request resends this one's answer (ShareGPT), so the answer's ids must match.
    """

    line: int
    arrival: float
    prompt_len: int
    output_len: int
    prompt_tokens: list[int] | None = None
    id: Hashable = None
    hash_ids: tuple[int, ...] | None = None
    hash_block_size: int = 0
    output_tokens: list[int] | None = None
    conversation: int = -1
    turn: int = 0


@dataclass(slots=True)
class Trace:
    """The rows of a trace file, and what was skipped, by reason (reason -> [count, first line])."""

    path: Path
    format: str
    rows: list[TraceRow]
    skipped: dict[str, list[int]] = field(default_factory=dict)

    def skip(self, reason: str, line: int) -> None:
        entry = self.skipped.setdefault(reason, [0, line])
        entry[0] += 1

    def skipped_text(self) -> str:
        """One clause per reason (``"3 rows with 0 response tokens (first: line 7)"``), or ``""``."""
        parts = [
            f"{n} row{'s' if n != 1 else ''} {why} (first: line {first})" for why, (n, first) in self.skipped.items()
        ]
        return "; ".join(parts)


class _Where:
    """Names a line of a file in every message: ``workload.trace 'f.csv' line 3``."""

    __slots__ = ("prefix",)

    def __init__(self, path: Path) -> None:
        self.prefix = f"workload.trace '{path}'"

    def __call__(self, line: int) -> str:
        return f"{self.prefix} line {line}"


_JSON_TYPES = {type(None): "null", bool: "boolean", int: "number", float: "number", str: "string", list: "list"}


def describe(v: Any) -> str:
    """A JSON value as a trace's author wrote it: ``string "12"``, ``number 5``, ``null``."""
    kind = _JSON_TYPES.get(type(v), "object")
    if v is None:
        return kind
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else str(v)
    return f"{kind} {text[:40]}"


def _count(v: Any, where: str, key: str, low: int = 1) -> int:
    """A token count: a JSON integer (or an integral number such as ``1e3``) >= ``low``."""
    if isinstance(v, bool) or not isinstance(v, int | float) or (isinstance(v, float) and not v.is_integer()):
        raise ConfigError(f"{where}: '{key}' must be an integer >= {low}, got {describe(v)}")
    if v < low:
        raise ConfigError(f"{where}: '{key}' must be an integer >= {low}, got {v}")
    return int(v)


def _seconds(v: Any, where: str, key: str, unit: str = "seconds") -> float:
    """A time: a finite number >= 0 (a NaN would stall the simulated clock)."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise ConfigError(f"{where}: '{key}' must be a number of {unit} >= 0, got {describe(v)}")
    if not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}: '{key}' must be a finite number of {unit} >= 0, got {v}")
    return float(v)


def _tokens(v: Any, where: str) -> list[int]:
    if not isinstance(v, list) or not v:
        raise ConfigError(f"{where}: 'prompt_tokens' must be a non-empty list of token ids, got {describe(v)}")
    for t in v:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ConfigError(f"{where}: 'prompt_tokens' must hold integers >= 0, got {describe(t)}")
    return v


def _hash_ids(v: Any, n_prompt: int, block: int, where: str, key: str = "hash_ids") -> tuple[int, ...]:
    """Chained hashes covering ``n_prompt`` tokens in blocks of ``block``: exactly ``ceil(n / block)`` of them."""
    if not isinstance(v, list):
        raise ConfigError(f"{where}: '{key}' must be a list of integers, got {describe(v)}")
    for h in v:
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < 1 << 63:
            raise ConfigError(f"{where}: '{key}' must hold integers in [0, 2**63), got {describe(h)}")
    need = -(-n_prompt // block)
    if len(v) > need:
        raise ConfigError(
            f"{where}: '{key}' has {len(v)} entries, but {n_prompt} input tokens allow at most {need} blocks of {block}"
        )
    if len(v) < need:
        raise ConfigError(
            f"{where}: '{key}' has {len(v)} entries, but {n_prompt} input tokens need {need} blocks of {block}"
        )
    return tuple(v)


def _json_lines(text: str, where: _Where, expected: tuple[str, ...]) -> Iterator[tuple[int, dict[str, Any]]]:
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{where(lineno)}: not JSON ({exc.msg}); expected one object per line with keys {list(expected)}"
            ) from None
        if not isinstance(row, dict):
            raise ConfigError(
                f"{where(lineno)}: expected a JSON object, got {describe(row)}; expected keys {list(expected)}"
            )
        unknown = set(row) - set(expected)
        if unknown:
            raise ConfigError(f"{where(lineno)}: unknown key(s) {sorted(unknown)}; expected keys {list(expected)}")
        yield lineno, row


def _read_jsonl(path: Path, text: str) -> Trace:
    where = _Where(path)
    trace = Trace(path, "jsonl", [])
    sessions: dict[int, Hashable] = {}  # line -> its session, where given
    for lineno, row in _json_lines(text, where, _JSONL_KEYS):
        w = where(lineno)
        if "arrival" not in row or "output_len" not in row:
            raise ConfigError(f"{w}: needs numeric 'arrival' and 'output_len'")
        arrival = _seconds(row["arrival"], w, "arrival")
        n_out = _count(row["output_len"], w, "output_len")
        tokens = None
        hashes = None
        block = 0
        if "prompt_tokens" in row:
            tokens = _tokens(row["prompt_tokens"], w)
            n_prompt = len(tokens)
            if "prompt_len" in row and _count(row["prompt_len"], w, "prompt_len") != n_prompt:
                raise ConfigError(f"{w}: 'prompt_len' ({row['prompt_len']}) differs from len(prompt_tokens)")
            if "hash_ids" in row:
                raise ConfigError(f"{w}: give 'prompt_tokens' or 'hash_ids', not both")
        elif "prompt_len" in row:
            n_prompt = _count(row["prompt_len"], w, "prompt_len")
        else:
            raise ConfigError(f"{w}: needs 'prompt_tokens' or 'prompt_len'")
        if "hash_ids" in row:
            if "hash_block_size" not in row:
                raise ConfigError(f"{w}: 'hash_ids' needs 'hash_block_size' (tokens per hash)")
            block = _count(row["hash_block_size"], w, "hash_block_size")
            hashes = _hash_ids(row["hash_ids"], n_prompt, block, w)
        elif "hash_block_size" in row:
            raise ConfigError(f"{w}: 'hash_block_size' without 'hash_ids'")
        rid = row.get("id", lineno)
        if isinstance(rid, bool) or not isinstance(rid, int | str):
            raise ConfigError(f"{w}: 'id' must be a string or an integer, got {describe(rid)}")
        session = row.get("session")
        if "session" in row and (isinstance(session, bool) or not isinstance(session, int | str)):
            raise ConfigError(f"{w}: 'session' must be a string or an integer, got {describe(session)}")
        trace.rows.append(TraceRow(lineno, arrival, n_prompt, n_out, tokens, rid, hashes, block))
        if session is not None:
            sessions[lineno] = session
    seen: dict[Hashable, int] = {}
    for r in trace.rows:
        if r.id in seen:
            raise ConfigError(f"{where(r.line)}: 'id' {r.id!r} was already used on line {seen[r.id]}")
        seen[r.id] = r.line
    if sessions:
        trace.rows = _number_sessions(trace.rows, sessions)
    return trace


def _number_sessions(rows: list[TraceRow], sessions: dict[int, Hashable]) -> list[TraceRow]:
    """Rows with ``conversation`` and ``turn`` set from their session (line -> session), turns in arrival order.

    Conversations are numbered in the order of their first turn.
    """
    convs: dict[Hashable, int] = {}
    turns: dict[int, int] = {}
    out = list(rows)
    for k in sorted(range(len(rows)), key=lambda k: (rows[k].arrival, rows[k].line)):
        r = rows[k]
        if r.line not in sessions:
            continue
        conv = convs.setdefault(sessions[r.line], len(convs))
        turn = turns.get(conv, 0)
        turns[conv] = turn + 1
        out[k] = replace(r, conversation=conv, turn=turn)
    return out


class _Clock:
    """Arrival times of a log: seconds since its first row; a step backwards is refused.

    ``per_second`` is how many units of the timestamps make a second (Mooncake's are milliseconds).
    The refusal shows both timestamps as the file wrote them, both lines, and the step back in
    the file's unit: two epoch times a fraction of a second apart look alike in any short
    rendering of a float.
    """

    __slots__ = ("first", "last", "last_line", "last_text", "per_second", "unit_name")

    def __init__(self, per_second: float = 1.0, unit_name: str = "s") -> None:
        self.first: float | None = None
        self.last = -math.inf
        self.last_line = 0
        self.last_text = ""
        self.per_second = per_second
        self.unit_name = unit_name

    def at(self, t: float, line: int, where: str, key: str, text: str) -> float:
        """Seconds of ``t`` (written ``text`` on ``line``) since the first row."""
        if t < self.last:
            raise ConfigError(
                f"{where}: '{key}' goes backwards ({text} is {round(self.last - t, 7):.10g} {self.unit_name} before "
                f"{self.last_text} on line {self.last_line}); a log must be in time order"
            )
        if self.first is None:
            self.first = t
        self.last, self.last_line, self.last_text = t, line, text
        return (t - self.first) / self.per_second


def _read_mooncake(path: Path, text: str) -> Trace:
    where = _Where(path)
    trace = Trace(path, "mooncake", [])
    clock = _Clock(1e3, "ms")
    convs: dict[tuple[int, ...], int] = {}
    turns: dict[int, int] = {}
    for lineno, row in _json_lines(text, where, _MOONCAKE_KEYS):
        w = where(lineno)
        missing = [k for k in _MOONCAKE_KEYS if k not in row]
        if missing:
            raise ConfigError(f"{w}: missing key(s) {missing}; expected keys {list(_MOONCAKE_KEYS)}")
        t_ms = _seconds(row["timestamp"], w, "timestamp", "milliseconds")
        n_in = _count(row["input_length"], w, "input_length", low=0)
        n_out = _count(row["output_length"], w, "output_length", low=0)
        arrival = clock.at(t_ms, lineno, w, "timestamp", json.dumps(row["timestamp"]))
        if n_in == 0:
            trace.skip("with 0 input tokens", lineno)
            continue
        hashes = _hash_ids(row["hash_ids"], n_in, MOONCAKE_BLOCK, w)
        if n_out == 0:
            trace.skip("with 0 output tokens", lineno)
            continue
        # No session ids in Mooncake's traces: requests that share their first two blocks (1,024
        # tokens: the shared system prompt, then the conversation's own start) are one conversation,
        # as a router with prefix affinity would send them to one instance.
        conv = convs.setdefault(hashes[:2], len(convs))
        turn = turns.get(conv, 0)
        turns[conv] = turn + 1
        trace.rows.append(
            TraceRow(lineno, arrival, n_in, n_out, None, lineno, hashes, MOONCAKE_BLOCK, None, conv, turn)
        )
    return trace


def _csv_rows(
    text: str, where: _Where, columns: tuple[str, ...], required: tuple[str, ...]
) -> Iterator[tuple[int, dict[str, str]]]:
    reader = csv.reader(io.StringIO(text))
    header: list[str] | None = None
    for fields in reader:
        lineno = reader.line_num
        if header is None:
            if not fields or not any(f.strip() for f in fields):
                continue
            header = [f.strip() for f in fields]
            missing = [c for c in required if c not in header]
            if missing:
                raise ConfigError(
                    f"{where(lineno)}: the header lacks column(s) {missing}; expected the columns {','.join(columns)}"
                )
            continue
        if not fields:
            continue
        if len(fields) != len(header):
            raise ConfigError(
                f"{where(lineno)}: {len(fields)} fields where the header has {len(header)}; "
                f"expected the columns {','.join(header)}"
            )
        yield lineno, dict(zip(header, (f.strip() for f in fields), strict=True))
    if header is None:
        raise ConfigError(f"{where.prefix}: has no header; expected the columns {','.join(columns)}")


def _cell_count(v: str, where: str, col: str, columns: tuple[str, ...]) -> int:
    try:
        n = float(v)
    except ValueError:
        raise ConfigError(
            f"{where}: '{col}' must be a token count, got {v!r}; expected the columns {','.join(columns)}"
        ) from None
    if not math.isfinite(n) or not n.is_integer():
        raise ConfigError(f"{where}: '{col}' must be a whole number of tokens, got {v!r}")
    if n < 0:
        raise ConfigError(f"{where}: '{col}' must be >= 0, got {v}")
    return int(n)


# Azure's times are counted from here, not from 1970: a float of seconds since 1970 carries only
# about 0.24 us at today's dates, coarser than the 2023 traces' 100 ns ticks.
_AZURE_EPOCH = datetime(2020, 1, 1, tzinfo=timezone.utc)


def _azure_time(v: str, where: str) -> float:
    """Seconds since 2020-01-01 UTC of ``2023-11-16 18:15:46.6805900`` (7 digits) or ``...009930+00:00``.

    Whole seconds and the fraction are added last, so a 100 ns tick survives (about 15 ns of
    rounding at these magnitudes).
    """
    s = v.strip()
    zone = timezone.utc
    if len(s) > 6 and s[-6] in "+-" and s[-3] == ":":  # an offset; the 2024 traces say +00:00
        sign = 1 if s[-6] == "+" else -1
        zone = timezone(sign * timedelta(hours=int(s[-5:-3]), minutes=int(s[-2:])))
        s = s[:-6]
    frac = 0.0
    if "." in s:
        s, digits = s.split(".", 1)
        if not digits.isdigit():
            raise ConfigError(f"{where}: 'TIMESTAMP' must look like 2023-11-16 18:15:46.6805900, got {v!r}")
        frac = int(digits) / 10 ** len(digits)  # any number of digits: the 2023 traces have 100 ns ticks
    try:
        t = datetime.strptime(s, "%Y-%m-%d %H:%M:%S").replace(tzinfo=zone)
    except ValueError:
        raise ConfigError(f"{where}: 'TIMESTAMP' must look like 2023-11-16 18:15:46.6805900, got {v!r}") from None
    return (t - _AZURE_EPOCH).total_seconds() + frac


def _read_azure(path: Path, text: str) -> Trace:
    where = _Where(path)
    trace = Trace(path, "azure", [])
    clock = _Clock()
    for lineno, row in _csv_rows(text, where, _AZURE_COLUMNS, _AZURE_COLUMNS):
        w = where(lineno)
        empty = [c for c in _AZURE_COLUMNS if not row[c]]
        if empty:
            trace.skip(f"with an empty {empty[0]}", lineno)
            continue
        arrival = clock.at(_azure_time(row["TIMESTAMP"], w), lineno, w, "TIMESTAMP", row["TIMESTAMP"])
        n_in = _cell_count(row["ContextTokens"], w, "ContextTokens", _AZURE_COLUMNS)
        n_out = _cell_count(row["GeneratedTokens"], w, "GeneratedTokens", _AZURE_COLUMNS)
        if n_in == 0:
            trace.skip("with 0 ContextTokens", lineno)
        elif n_out == 0:
            trace.skip("with 0 GeneratedTokens", lineno)
        else:
            trace.rows.append(TraceRow(lineno, arrival, n_in, n_out, None, lineno))
    return trace


def _read_burstgpt(path: Path, text: str) -> Trace:
    where = _Where(path)
    trace = Trace(path, "burstgpt", [])
    clock = _Clock()
    sessions: dict[str, int] = {}
    turns: dict[int, int] = {}
    for lineno, row in _csv_rows(text, where, _BURST_COLUMNS, _BURST_REQUIRED):
        w = where(lineno)
        empty = [c for c in _BURST_REQUIRED if not row[c]]
        if empty:
            trace.skip(f"with an empty {empty[0]}", lineno)
            continue
        try:
            t = float(row["Timestamp"])
        except ValueError:
            raise ConfigError(f"{w}: 'Timestamp' must be a number of seconds, got {row['Timestamp']!r}") from None
        if not math.isfinite(t) or t < 0:
            raise ConfigError(f"{w}: 'Timestamp' must be a finite number of seconds >= 0, got {row['Timestamp']!r}")
        arrival = clock.at(t, lineno, w, "Timestamp", row["Timestamp"])
        n_in = _cell_count(row["Request tokens"], w, "Request tokens", _BURST_COLUMNS)
        n_out = _cell_count(row["Response tokens"], w, "Response tokens", _BURST_COLUMNS)
        if n_out == 0:  # BurstGPT's failed requests
            trace.skip("with 0 Response tokens (failed requests)", lineno)
            continue
        if n_in == 0:
            trace.skip("with 0 Request tokens", lineno)
            continue
        conv, turn = -1, 0
        session = row.get("Session ID", "")
        if session:
            conv = sessions.setdefault(session, len(sessions))
            turn = turns.get(conv, 0)
            turns[conv] = turn + 1
        trace.rows.append(TraceRow(lineno, arrival, n_in, n_out, None, lineno, conversation=conv, turn=turn))
    return trace


def _text_tokens(text: str) -> int:
    return max(1, -(-len(text.encode()) // SHAREGPT_BYTES_PER_TOKEN))


def _read_sharegpt(path: Path, text: str, rate: float) -> Trace:
    where = _Where(path)
    trace = Trace(path, "sharegpt", [])
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{where(exc.lineno)}: not JSON ({exc.msg}); expected a list of "
            '{"id", "conversations": [{"from", "value"}, ...]}'
        ) from None
    if not isinstance(doc, list):
        raise ConfigError(f"{where(1)}: expected a JSON list of conversations, got {describe(doc)}")
    # json.loads keeps no line numbers: a conversation is known by its position (and its id).
    next_id = 1
    for ci, conv in enumerate(doc):
        w = f"{where.prefix} conversation {ci}"
        if not isinstance(conv, dict) or not isinstance(conv.get("conversations"), list):
            raise ConfigError(f"{w}: expected an object with a 'conversations' list, got {describe(conv)}")
        cid = conv.get("id", ci)
        history: list[int] = []
        arrival = ci / rate
        turn = 0
        msgs = conv["conversations"]
        for mi, msg in enumerate(msgs):
            if not isinstance(msg, dict) or not isinstance(msg.get("value"), str) or msg.get("from") is None:
                raise ConfigError(f"{w} turn {mi}: expected {{'from': ..., 'value': text}}, got {describe(msg)}")
            if msg["from"] != "human":
                continue
            user = list(range(next_id, next_id + _text_tokens(msg["value"])))
            next_id += len(user)
            nxt = msgs[mi + 1] if mi + 1 < len(msgs) else None
            if not isinstance(nxt, dict) or nxt.get("from") == "human" or not isinstance(nxt.get("value"), str):
                trace.skip("with a human turn and no answer after it", ci)
                history += user
                continue
            answer = list(range(next_id, next_id + _text_tokens(nxt["value"])))
            next_id += len(answer)
            prompt = history + user
            trace.rows.append(
                TraceRow(ci, arrival, len(prompt), len(answer), prompt, f"{cid}:{turn}", None, 0, answer, ci, turn)
            )
            history = prompt + answer
            arrival += SHAREGPT_THINK_S
            turn += 1
    trace.rows.sort(key=lambda r: r.arrival)
    return trace


def read(path: Path, fmt: str = "jsonl", rate: float = 1.0) -> Trace:
    """Read and validate a trace file of format ``fmt`` (one of :data:`FORMATS`).

    ``rate`` (conversations per second) places ShareGPT's conversations in time.
    Raises ConfigError naming the file, the line and the problem; an empty trace
    (no replayable row) is refused too.
    """
    if fmt not in FORMATS:
        raise ConfigError(f"workload.trace '{path}': unknown trace format {fmt!r}; expected one of {list(FORMATS)}")
    # A spreadsheet saves UTF-8 with a byte-order mark; it is no part of the first column's name.
    # (CRLF line ends need nothing: the text is read with universal newlines.)
    text = read_text(path, "workload.trace").removeprefix("\ufeff")
    if fmt == "jsonl":
        trace = _read_jsonl(path, text)
    elif fmt == "mooncake":
        trace = _read_mooncake(path, text)
    elif fmt == "azure":
        trace = _read_azure(path, text)
    elif fmt == "burstgpt":
        trace = _read_burstgpt(path, text)
    else:
        trace = _read_sharegpt(path, text, rate)
    if not trace.rows:
        skipped = f" ({trace.skipped_text()})" if trace.skipped else ""
        raise ConfigError(f"workload.trace '{path}' line 1: has no requests{skipped}")
    return trace


def to_jsonl(rows: list[TraceRow]) -> str:
    """Rows in this package's ``jsonl`` layout (hashes, ids and conversations kept: a conversion loses no sharing)."""
    out = []
    for r in rows:
        d: dict[str, Any] = {"id": r.id, "arrival": round(r.arrival, 6), "output_len": r.output_len}
        if r.conversation >= 0:
            d["session"] = r.conversation
        if r.prompt_tokens is not None:
            d["prompt_tokens"] = r.prompt_tokens
        else:
            d["prompt_len"] = r.prompt_len
        if r.hash_ids is not None:
            d["hash_ids"] = list(r.hash_ids)
            d["hash_block_size"] = r.hash_block_size
        out.append(json.dumps(d))
    return "\n".join(out) + "\n"


def to_mooncake(rows: list[TraceRow]) -> str:
    """Rows in Mooncake's layout; each needs hashes at Mooncake's 512 tokens (other rows cannot say their sharing)."""
    out = []
    for r in rows:
        if r.hash_ids is None or r.hash_block_size != MOONCAKE_BLOCK:
            raise ConfigError(
                f"trace convert: line {r.line} has no hash ids at {MOONCAKE_BLOCK} tokens, which the mooncake "
                "format needs; convert to jsonl instead"
            )
        d = {
            "timestamp": round(r.arrival * 1e3),
            "input_length": r.prompt_len,
            "output_length": r.output_len,
            "hash_ids": list(r.hash_ids),
        }
        out.append(json.dumps(d))
    return "\n".join(out) + "\n"


def to_azure(rows: list[TraceRow]) -> str:
    """Rows as an Azure CSV (lengths only: token ids and hashes are dropped), times from 2023-11-16 00:00 UTC."""
    base = datetime(2023, 11, 16, tzinfo=timezone.utc).timestamp()
    lines = [",".join(_AZURE_COLUMNS)]
    for r in rows:
        t = datetime.fromtimestamp(base + r.arrival, timezone.utc)
        lines.append(f"{t.strftime('%Y-%m-%d %H:%M:%S')}.{t.microsecond:06d}0,{r.prompt_len},{r.output_len}")
    return "\n".join(lines) + "\n"


def to_burstgpt(rows: list[TraceRow]) -> str:
    """Rows as a BurstGPT CSV (lengths only), model and log type left as unknown."""
    lines = [",".join(_BURST_COLUMNS)]
    for r in rows:
        total = r.prompt_len + r.output_len
        lines.append(f"{r.arrival:.3f},unknown,{r.prompt_len},{r.output_len},{total},unknown")
    return "\n".join(lines) + "\n"


def sample(rows: list[TraceRow], window: tuple[float, float] | None = None, every: int = 1) -> list[TraceRow]:
    """The requests arriving in ``window`` (seconds), of every ``every``-th conversation.

    A row without a conversation (``conversation == -1``) is a conversation of its
    own.  Conversations are numbered in the order of their first request, and one
    is kept or dropped as a whole, so a kept follow-up finds the turns it resends
    (unless they came before the window).  Kept rows keep their own times, shifted
    so that the first one arrives at 0.
    """
    if window is not None:
        rows = [r for r in rows if window[0] <= r.arrival < window[1]]
    if every > 1:
        order: dict[tuple[int, int], int] = {}
        for r in sorted(rows, key=lambda r: (r.arrival, r.line)):
            order.setdefault(_conversation(r), len(order))
        rows = [r for r in rows if order[_conversation(r)] % every == 0]
    if not rows:
        return rows
    t0 = min(r.arrival for r in rows)
    return [replace(r, arrival=r.arrival - t0) for r in rows]


def _conversation(r: TraceRow) -> tuple[int, int]:
    return (r.conversation, -1) if r.conversation >= 0 else (-1, r.line)


WRITERS = {"jsonl": to_jsonl, "mooncake": to_mooncake, "azure": to_azure, "burstgpt": to_burstgpt}
