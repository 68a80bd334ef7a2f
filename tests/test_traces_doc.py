"""docs/traces.md: every format's example file reads as the page says, also as a spreadsheet saves it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tiered_kv.sim import trace_formats

DOC = Path(__file__).resolve().parent.parent / "docs" / "traces.md"


def examples() -> dict[str, str]:
    """Format -> the text of its example file (the fenced block after ``<!-- example: FMT -->``)."""
    found = re.findall(r"<!-- example: (\w+) -->\n```\w*\n(.*?)```", DOC.read_text(), flags=re.S)
    return dict(found)


def _rows(trace: trace_formats.Trace) -> list[tuple]:
    return [
        (r.line, round(r.arrival, 7), r.prompt_len, r.output_len, r.id, r.hash_ids, r.conversation, r.turn)
        for r in trace.rows
    ]


# Worked out by hand from the examples in docs/traces.md.
EXPECTED = {
    "jsonl": [
        (1, 0.0, 1200, 150, "q1", None, 0, 0),
        (2, 0.4, 4, 20, "q2", None, -1, 0),
        (3, 9.5, 1500, 80, "q3", (11, 12, 13), 0, 1),  # alice's second turn
    ],
    "mooncake": [
        (1, 0.0, 1100, 5, 1, (0, 1, 2), 0, 0),
        (2, 1.5, 700, 3, 2, (0, 3), 1, 0),
        (3, 2.75, 1500, 20, 3, (0, 1, 4), 0, 1),  # shares its first two hashes with line 1
    ],
    "azure": [
        (2, 0.0, 374, 44, 2, None, -1, 0),
        (3, 4.314579, 396, 109, 3, None, -1, 0),
    ],
    "burstgpt": [
        (2, 0.0, 472, 18, 2, None, -1, 0),
        (3, 40.0, 1087, 230, 3, None, -1, 0),
    ],
    # One token per 4 UTF-8 bytes: "What is a KV cache?" 19 -> 5; its answer 35 -> 9; "Why move it to
    # the CPU?" 23 -> 6, resent after the first turn (5 + 9 + 6 = 20); "GPU memory runs out first." 26
    # -> 7; "Hello" 5 -> 2; "Hi!" 3 -> 1.  c2 starts 1 s after c1 (rate 1); c1's follow-up 10 s after it.
    "sharegpt": [
        (0, 0.0, 5, 9, "c1:0", None, 0, 0),
        (1, 1.0, 2, 1, "c2:0", None, 1, 0),
        (0, 10.0, 20, 7, "c1:1", None, 0, 1),
    ],
}


def test_the_page_has_one_three_line_example_per_format():
    ex = examples()
    assert sorted(ex) == sorted(trace_formats.FORMATS)
    for fmt, text in ex.items():
        assert text.count("\n") == 3 and text.endswith("\n"), fmt


@pytest.mark.parametrize("fmt", trace_formats.FORMATS)
def test_each_example_reads_as_the_page_says(fmt, tmp_path):
    p = tmp_path / f"example.{fmt}"
    p.write_text(examples()[fmt])
    trace = trace_formats.read(p, fmt)
    assert _rows(trace) == EXPECTED[fmt]
    assert trace.skipped == {}


@pytest.mark.parametrize("fmt", trace_formats.FORMATS)
def test_a_file_saved_by_a_spreadsheet_reads_the_same(fmt, tmp_path):
    # Excel's "CSV UTF-8" starts the file with a byte-order mark and ends lines with CRLF.
    p = tmp_path / f"saved.{fmt}"
    p.write_bytes(b"\xef\xbb\xbf" + examples()[fmt].replace("\n", "\r\n").encode())
    assert _rows(trace_formats.read(p, fmt)) == EXPECTED[fmt]
