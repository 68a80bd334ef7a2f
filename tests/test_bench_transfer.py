"""Smoke test of ``tiered-kv bench-transfer``: every case writes a complete JSON row."""

import json

from tiered_kv.cli import main

FIELDS = {"layout", "block_tokens", "kv_shape", "pattern", "direction", "gbps", "peak_gbps", "ratio", "engine"}


def test_bench_transfer_writes_one_row_per_case(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    assert main(["bench-transfer", "--mib", "4", "--block-tokens", "16,32", "--repeats", "1", "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # 2 layouts x 2 block sizes x (2 patterns x 2 directions + interleaved)
    assert len(rows) == 2 * 2 * 5
    for r in rows:
        assert FIELDS <= set(r)
        assert r["gbps"] > 0 and r["peak_gbps"] > 0 and abs(r["ratio"] - r["gbps"] / r["peak_gbps"]) < 1e-9
        assert r["kv_shape"] == "32x8x128 bfloat16"
    assert {r["pattern"] for r in rows} == {"contiguous", "scattered", "interleaved"}
    assert "GB/s" in capsys.readouterr().out
