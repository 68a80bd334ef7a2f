"""Trace files as users bring them: saved by a spreadsheet, with a timestamp out of order, with 100 ns ticks."""

from __future__ import annotations

import json

import pytest

from tiered_kv.errors import ConfigError
from tiered_kv.sim import trace_formats


@pytest.mark.parametrize(
    ("fmt", "text", "row"),
    [
        ("azure", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n", (2, 0.0, 374, 44)),
        ("burstgpt", "Timestamp,Request tokens,Response tokens\n5,472,18\n", (2, 0.0, 472, 18)),
    ],
)
def test_a_csv_saved_by_a_spreadsheet_is_read(tmp_path, fmt, text, row):
    # Excel's "CSV UTF-8": a byte-order mark before the header, CRLF line ends.  The mark was read as
    # part of the first column's name: "the header lacks column(s) ['TIMESTAMP']".
    p = tmp_path / "saved.csv"
    p.write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    assert [(r.line, r.arrival, r.prompt_len, r.output_len) for r in trace_formats.read(p, fmt).rows] == [row]


@pytest.mark.parametrize(
    ("fmt", "text", "message"),
    [
        (  # epoch seconds a quarter second apart: "1.70016e+09 after 1.70016e+09" said nothing
            "burstgpt",
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "1700160000.75,ChatGPT,472,18,490,x\n1700160000.5,ChatGPT,10,1,11,x\n",
            "line 3: 'Timestamp' goes backwards (1700160000.5 is 0.25 s before 1700160000.75 on line 2); "
            "a log must be in time order",
        ),
        (  # the 2023 traces' 100 ns ticks: one tick back is named as one tick
            "azure",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n"
            "2023-11-16 18:15:46.6805901,374,44\n2023-11-16 18:15:46.6805900,396,109\n",
            "line 3: 'TIMESTAMP' goes backwards (2023-11-16 18:15:46.6805900 is 1e-07 s before "
            "2023-11-16 18:15:46.6805901 on line 2); a log must be in time order",
        ),
        (
            "mooncake",
            '{"timestamp": 1700160000750, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
            '{"timestamp": 1700160000500, "input_length": 5, "output_length": 1, "hash_ids": [2]}\n',
            "line 2: 'timestamp' goes backwards (1700160000500 is 250 ms before 1700160000750 on line 1); "
            "a log must be in time order",
        ),
    ],
)
def test_a_timestamp_that_goes_back_is_shown_as_written_with_the_step(tmp_path, fmt, text, message):
    p = tmp_path / "t.txt"
    p.write_text(text)
    with pytest.raises(ConfigError) as info:
        trace_formats.read(p, fmt)
    assert str(info.value) == f"workload.trace '{p}' {message}"


def test_azure_keeps_its_100_ns_ticks(tmp_path):
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:46.6805901,396,109\n"
    )
    gap = trace_formats.read(p, "azure").rows[1].arrival
    assert gap == pytest.approx(1e-7, rel=0.2)  # as seconds since 1970, a float made it 2.4e-7


def test_jsonl_sessions_are_conversations_and_a_conversion_keeps_them(tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_text(
        '{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n'
        '{"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [0, 3]}\n'
        '{"timestamp": 2750, "input_length": 1500, "output_length": 20, "hash_ids": [0, 1, 4]}\n'
    )
    rows = trace_formats.read(src, "mooncake").rows
    out = tmp_path / "ours.jsonl"
    out.write_text(trace_formats.to_jsonl(rows))
    assert [json.loads(x)["session"] for x in out.read_text().splitlines()] == [0, 1, 0]
    back = trace_formats.read(out, "jsonl").rows
    turns = [(0, 0), (1, 0), (0, 1)]  # lines 1 and 3 share their first two hashes
    assert [(r.conversation, r.turn) for r in back] == [(r.conversation, r.turn) for r in rows] == turns


@pytest.mark.parametrize("session", [True, 1.5, None, [1]])
def test_a_jsonl_session_is_a_string_or_an_integer(tmp_path, session):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"arrival": 0, "prompt_len": 4, "output_len": 1, "session": session}) + "\n")
    with pytest.raises(ConfigError, match=r"line 1: 'session' must be a string or an integer, got"):
        trace_formats.read(p, "jsonl")
