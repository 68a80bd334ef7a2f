"""Public trace formats, each from a small file in its real layout; bad input; the shipped Mooncake trace."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from simutil import config, run

from tiered_kv.cli import main
from tiered_kv.errors import ConfigError
from tiered_kv.sim import trace_formats, trace_stats
from tiered_kv.sim.workload import load_trace

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "configs" / "traces" / "mooncake" / "conversation_trace.jsonl"


def _write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# Mooncake's layout (FAST25-release/traces): ms timestamps, one hash id per 512 input tokens.
MOONCAKE_ROWS = (
    '{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n'
    '{"timestamp": 1500, "input_length": 700, "output_length": 3, "hash_ids": [0, 3]}\n'
    '{"timestamp": 1500, "input_length": 1030, "output_length": 2, "hash_ids": [0, 1, 4]}\n'
)


def test_mooncake_rows_keep_their_hashes_and_times(tmp_path):
    trace = trace_formats.read(_write(tmp_path, "m.jsonl", MOONCAKE_ROWS), "mooncake")
    assert [(r.line, r.arrival, r.prompt_len, r.output_len, r.hash_ids) for r in trace.rows] == [
        (1, 0.0, 1100, 5, (0, 1, 2)),
        (2, 1.5, 700, 3, (0, 3)),
        (3, 1.5, 1030, 2, (0, 1, 4)),
    ]
    assert all(r.hash_block_size == 512 and r.prompt_tokens is None for r in trace.rows)
    # Rows 1 and 3 share their first two blocks: one conversation; row 2 is another.
    assert [(r.conversation, r.turn) for r in trace.rows] == [(0, 0), (1, 0), (0, 1)]
    reqs = load_trace(tmp_path / "m.jsonl", fmt="mooncake")
    assert [(r.prompt, r.prompt_len, r.hashes, len(r.output)) for r in reqs] == [
        ([], 1100, (0, 1, 2), 5),
        ([], 700, (0, 3), 3),
        ([], 1030, (0, 1, 4), 2),
    ]


def test_a_mooncake_trace_replays_and_its_shared_blocks_hit(tmp_path):
    p = _write(tmp_path, "m.jsonl", MOONCAKE_ROWS)
    res, _ = run(
        _tiny_trace(p, "mooncake", block_size=16, gpu_blocks=400),
    )
    assert res["requests_finished"] == 3 and res["output_tokens"] == 10
    # Each request computes its prompt and all but its last output token: 2830 + 10 - 3 without reuse.
    # Request 3 finds blocks 0 and 1 of request 1 (1024 tokens: 64 blocks of 16) on the GPU; request 2
    # finds block 0 (512 tokens: 32 blocks): 1536 tokens are not computed.
    assert res["tokens_computed"] == 2837 - 1536


def _tiny_trace(path: Path, fmt: str, block_size: int = 4, gpu_blocks: int = 64):
    return config(
        workload__trace=str(path),
        workload__trace_format=fmt,
        memory__block_size=block_size,
        memory__gpu_blocks=gpu_blocks,
        scheduler__max_num_batched_tokens=4096,
    )


# The Azure LLM inference traces: 2023 (AzureLLMInferenceTrace_code/conv.csv, 100 ns ticks) ...
AZURE_2023 = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
    "2023-11-16 18:15:51.0000000,0,7\n"
    "2023-11-16 18:15:52.2000000,12,0\n"
)
# ... and 2024 (AzureLLMInferenceTrace_code/conv_1week.csv, with a UTC offset).
AZURE_2024 = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2024-05-10 00:00:00.009930+00:00,2162,5\n"
    "2024-05-10 00:00:00.509930+00:00,80,300\n"
)


def test_azure_2023_rows_and_their_skips(tmp_path):
    trace = trace_formats.read(_write(tmp_path, "a.csv", AZURE_2023), "azure")
    assert [(r.line, round(r.arrival, 7), r.prompt_len, r.output_len) for r in trace.rows] == [
        (2, 0.0, 374, 44),
        (3, 4.314579, 396, 109),
    ]
    assert trace.skipped == {"with 0 ContextTokens": [1, 4], "with 0 GeneratedTokens": [1, 5]}
    assert trace.skipped_text() == (
        "1 row with 0 ContextTokens (first: line 4); 1 row with 0 GeneratedTokens (first: line 5)"
    )


def test_azure_2024_rows(tmp_path):
    trace = trace_formats.read(_write(tmp_path, "a.csv", AZURE_2024), "azure")
    assert [(r.arrival, r.prompt_len, r.output_len) for r in trace.rows] == [(0.0, 2162, 5), (0.5, 80, 300)]
    assert trace.skipped == {}


# BurstGPT (BurstGPT_1.csv): seconds; failed requests have 0 response tokens.
BURSTGPT = (
    "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    "5,ChatGPT,472,18,490,Conversation log\n"
    "45,ChatGPT,1087,230,1317,Conversation log\n"
    "118,GPT-4,417,0,417,API log\n"
    "120,GPT-4,300,12,312,API log\n"
    "121,GPT-4,310,0,310,Conversation log\n"
)


def test_burstgpt_rows_count_failed_requests(tmp_path):
    trace = trace_formats.read(_write(tmp_path, "b.csv", BURSTGPT), "burstgpt")
    assert [(r.line, r.arrival, r.prompt_len, r.output_len) for r in trace.rows] == [
        (2, 0.0, 472, 18),
        (3, 40.0, 1087, 230),
        (5, 115.0, 300, 12),
    ]
    assert trace.skipped == {"with 0 Response tokens (failed requests)": [2, 4]}


def test_burstgpt_with_sessions_numbers_conversations(tmp_path):
    text = (
        "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "1,aa,2,ChatGPT,10,5,15,Conversation log\n"
        "2,bb,2,ChatGPT,11,5,16,Conversation log\n"
        "3,aa,2,ChatGPT,12,5,17,Conversation log\n"
    )
    trace = trace_formats.read(_write(tmp_path, "b.csv", text), "burstgpt")
    assert [(r.conversation, r.turn) for r in trace.rows] == [(0, 0), (1, 0), (0, 1)]


# ShareGPT (ShareGPT_V3_unfiltered_cleaned_split.json): a list of conversations.
SHAREGPT = [
    {
        "id": "dsOTKpn_0",
        "conversations": [
            {"from": "human", "value": "abcdefgh"},  # 8 bytes: 2 tokens
            {"from": "gpt", "value": "0123456789ab"},  # 3 tokens
            {"from": "human", "value": "xyzw"},  # 1 token
            {"from": "gpt", "value": "12345678"},  # 2 tokens
        ],
    },
    {"id": "other_1", "conversations": [{"from": "human", "value": "hi"}]},
]


def test_sharegpt_turns_resend_the_conversation(tmp_path):
    p = _write(tmp_path, "s.json", json.dumps(SHAREGPT))
    trace = trace_formats.read(p, "sharegpt", rate=2.0)
    first, second = trace.rows
    assert (first.id, first.arrival, first.prompt_len, first.output_len) == ("dsOTKpn_0:0", 0.0, 2, 3)
    assert (second.id, second.arrival, second.prompt_len, second.output_len) == ("dsOTKpn_0:1", 10.0, 6, 2)
    # The follow-up's prompt is the first prompt, the first answer, then the new message.
    assert second.prompt_tokens == [*first.prompt_tokens, *first.output_tokens, 6]
    assert trace.skipped == {"with a human turn and no answer after it": [1, 1]}
    reqs = load_trace(p, fmt="sharegpt")
    assert list(reqs[0].output) == first.output_tokens


def test_sharegpt_replays_with_reuse(tmp_path):
    convs = [
        {
            "id": "c",
            "conversations": [
                {"from": "human", "value": "a" * 64},
                {"from": "gpt", "value": "b" * 32},
                {"from": "human", "value": "c" * 16},
                {"from": "gpt", "value": "d" * 8},
            ],
        }
    ]
    p = _write(tmp_path, "s.json", json.dumps(convs))
    res, _ = run(_tiny_trace(p, "sharegpt"))
    assert res["requests_finished"] == 2
    # Turn 1 computes 16 + 8 - 1 tokens (its last sampled token has no KV); turn 2 (16 + 8 + 4 = 28
    # tokens, 2 out) finds turn 1's first 20 of them, 5 full blocks of 4, cached: it computes 28 + 2 - 1 - 20.
    assert res["tokens_computed"] == 23 + 9


def test_convert_keeps_hashes_and_sample_keeps_whole_conversations(tmp_path, capsys):
    src = _write(tmp_path, "m.jsonl", MOONCAKE_ROWS)
    out = tmp_path / "ours.jsonl"
    assert main(["trace", "convert", str(src), "--format", "mooncake", "--to", "jsonl", "-o", str(out)]) == 0
    back = trace_formats.read(out, "jsonl")
    assert [(r.arrival, r.prompt_len, r.hash_ids, r.hash_block_size) for r in back.rows] == [
        (0.0, 1100, (0, 1, 2), 512),
        (1.5, 700, (0, 3), 512),
        (1.5, 1030, (0, 1, 4), 512),
    ]
    again = tmp_path / "again.jsonl"
    assert main(["trace", "convert", str(out), "--to", "mooncake", "-o", str(again)]) == 0
    assert again.read_text() == src.read_text()
    kept = tmp_path / "kept.jsonl"
    assert main(["trace", "sample", str(src), "--format", "mooncake", "--every", "2", "-o", str(kept)]) == 0
    # Every 2nd conversation from the first: conversation 0 (lines 1 and 3), both of its turns.
    assert [r.line for r in trace_formats.read(kept, "mooncake").rows] == [1, 2]
    assert [json.loads(x)["input_length"] for x in kept.read_text().splitlines()] == [1100, 1030]
    win = tmp_path / "win.jsonl"
    assert main(["trace", "sample", str(src), "--format", "mooncake", "--window", "1:2", "-o", str(win)]) == 0
    assert [json.loads(x)["timestamp"] for x in win.read_text().splitlines()] == [0, 0]
    capsys.readouterr()


@pytest.mark.parametrize(
    ("fmt", "text", "problem"),
    [
        (
            "mooncake",
            '{"timestamp": 10, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
            '{"timestamp": 4, "input_length": 5, "output_length": 1, "hash_ids": [2]}\n',
            "line 2: 'timestamp' goes backwards (4 is 6 ms before 10 on line 1); a log must be in time order",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": -3, "output_length": 1, "hash_ids": []}\n',
            "line 1: 'input_length' must be an integer >= 0, got -3",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}\n',
            "line 1: 'hash_ids' has 3 entries, but 600 input tokens allow at most 2 blocks of 512",
        ),
        (
            "mooncake",
            '{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1], "user": 3}\n',
            "line 1: unknown key(s) ['user']; expected keys ['timestamp', 'input_length', 'output_length', 'hash_ids']",
        ),
        ("mooncake", "", "line 1: has no requests"),
        (
            "azure",
            "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,-5,44\n",
            "line 2: 'ContextTokens' must be >= 0, got -5",
        ),
        (
            "azure",
            "time,prompt,output\n1,2,3\n",
            "line 1: the header lacks column(s) ['TIMESTAMP', 'ContextTokens', 'GeneratedTokens']; "
            "expected the columns TIMESTAMP,ContextTokens,GeneratedTokens",
        ),
        (
            "burstgpt",
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
            "5,ChatGPT,472,18,490,Conversation log\n3,ChatGPT,10,1,11,Conversation log\n",
            "line 3: 'Timestamp' goes backwards (3 is 2 s before 5 on line 2); a log must be in time order",
        ),
        (
            "burstgpt",
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n5,ChatGPT,many,18,490,x\n",
            "line 2: 'Request tokens' must be a token count, got 'many'; expected the columns "
            "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type",
        ),
        ("azure", "", "has no header; expected the columns TIMESTAMP,ContextTokens,GeneratedTokens"),
        ("jsonl", "TIMESTAMP,ContextTokens\n", "line 1: not JSON"),
        ("sharegpt", "", "line 1: not JSON"),
        ("parquet", "x\n", "unknown trace format 'parquet'; expected one of ['jsonl', 'mooncake', 'azure'"),
    ],
)
def test_bad_trace_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, fmt, text, problem):
    src = _write(tmp_path, "bad.txt", text)
    out = tmp_path / "out.jsonl"
    summary = tmp_path / "summary.json"
    for argv in (
        ["trace", "inspect", str(src), "--format", fmt, "--json", str(summary)],
        ["trace", "convert", str(src), "--format", fmt, "--to", "jsonl", "-o", str(out)],
        ["trace", "sample", str(src), "--format", fmt, "--every", "2", "-o", str(out)],
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert f"workload.trace '{src}'" in err and problem in err, err
        assert not out.exists() and not summary.exists()
    with pytest.raises(ConfigError, match=r"workload.trace '.*bad.txt'"):
        trace_formats.read(src, fmt)


def test_a_config_with_a_bad_trace_fails_before_any_run(tmp_path):
    src = _write(tmp_path, "bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,x,1\n")
    with pytest.raises(ConfigError, match=r"bad.csv' line 2: 'ContextTokens' must be a token count"):
        run(_tiny_trace(src, "azure"))


def test_inspect_prints_the_published_facts_of_the_shipped_trace(tmp_path, capsys):
    """Mooncake's paper (section 5.2.1, Table 2): input about 12k tokens, output 343, about 40% reusable.

    Tolerances follow the precision of each published figure: "about 12k" is rounded to thousands
    (within 500 tokens); 343 is rounded to a token (within 0.5); "about 40%" is one significant
    figure (within 5 points).  The computed reuse counts hit tokens of each prompt's chained
    512-token blocks up to its first miss, with an unbounded cache.
    """
    out = tmp_path / "m.json"
    assert main(["trace", "inspect", str(MOONCAKE), "--format", "mooncake", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["requests"] == 12031
    assert abs(doc["input_tokens"]["mean"] - 12000) <= 500
    assert abs(doc["output_tokens"]["mean"] - 343) <= 0.5
    assert abs(doc["reuse"]["inf"] - 0.40) <= 0.05
    assert doc["input_tokens"]["max"] <= 128 * 1024  # "up to 128k"
    assert f"input tokens:  mean {doc['input_tokens']['mean']:.0f}" in text
    assert "unbounded 37.4%" in text
    # A larger cache never hits less.
    rates = [doc["reuse"][str(c)] for c in trace_stats.CURVE_TOKENS]
    assert rates == sorted(rates) and rates[-1] == doc["reuse"]["inf"]


def test_hit_rates_are_lru_prefix_hits():
    # Three prompts of two 4-token blocks: B repeats A's first block, C repeats A entirely.
    reqs = [(8, [("a", 4), ("b", 4)]), (8, [("a", 4), ("x", 4)]), (8, [("a", 4), ("b", 4)])]
    # Room for 2 blocks: after B the cache holds a, x (b evicted): C hits only a.  Unbounded: C hits both.
    assert trace_stats.hit_rates(reqs, [8, 12, math.inf]) == [8 / 24, 12 / 24, 12 / 24]


def test_simulate_on_a_trace_says_where_the_gain_comes_from(tmp_path):
    import copy

    import yaml
    from reportutil import table
    from simutil import TINY

    from tiered_kv.cli.simulate import simulate

    src = _write(tmp_path, "m.jsonl", MOONCAKE_ROWS)
    raw = copy.deepcopy(TINY)
    raw["memory"].update({"block_size": 16, "gpu_blocks": 400, "cpu_kv_tokens": 3200})
    raw["scheduler"]["max_num_batched_tokens"] = 4096
    raw["workload"].update({"trace": "m.jsonl", "trace_format": "mooncake"})
    raw["runs"] = [
        {"name": "base", "mode": "recompute", "cpu_kv_tokens": 0},
        {"name": "tier", "mode": "recompute", "offload": "write_through", "vs": "base"},
    ]
    cfg = tmp_path / "t.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    lines: list[str] = []
    doc = simulate(cfg, None, tmp_path / "plots", emit=lines.append, progress=False)
    assert [r["cpu_blocks"] for r in doc["runs"]] == [0, 200]  # 3200 tokens in blocks of 16
    assert f"trace {src} (mooncake): 3 requests" in lines
    heads, rows = table(lines, "where the prompts' KV came from")
    assert heads == ["GPU", "CPU", "all", "saved", "loaded", "stored"]
    # Both compute 2837 - 1536 tokens (the GPU holds every shared block), so the tier avoids nothing.
    assert rows["base"][:4] == ["54.3%", "0.0%", "1301", "-"]
    assert rows["tier"][:4] == ["54.3%", "0.0%", "1301", "+0"]
    for name in ("prefix_hit_vs_capacity.png", "ttft_per_run.png"):
        assert (tmp_path / "plots" / name).stat().st_size > 1000


def test_a_bad_window_is_a_usage_error(capsys):
    assert main(["trace", "sample", "t.jsonl", "--window", "5:1", "-o", "o.jsonl"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "tiered-kv trace sample: error: argument --window: must be START:END seconds with 0 <= START < END, "
        "got '5:1' (see tiered-kv trace sample --help)\n"
    )


def test_inspect_of_a_lengths_only_trace_says_reuse_is_unknown(tmp_path, capsys):
    src = _write(tmp_path, "b.csv", BURSTGPT)
    assert main(["trace", "inspect", str(src), "--format", "burstgpt"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        f"{src}: 3 requests in 3 conversations over 115 s (0.02 requests/s)",
        "  input tokens:  mean 620, p50 472, p90 964, p99 1075, max 1087",
        "  output tokens: mean 86.7, p50 18, p90 188, p99 226, max 230",
        "  prefix reuse: not known (the format carries no token ids or prefix hashes)",
        "  skipped: 2 rows with 0 Response tokens (failed requests) (first: line 4)",
    ]
