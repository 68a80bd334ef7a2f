"""Every command fails on bad input with one line on stderr, exit status 2 and no traceback.

Each row builds its bad input in a temporary directory, runs ``tiered-kv`` in
process, and checks the one line against what it must name.  Rows with
``missing`` hide an optional package, as on an install without that extra.
"""

import json
import re
import sys
from dataclasses import dataclass, field

import pytest

from tiered_kv.cli import COMMANDS, main

GOOD_CAL = {
    "device": "cpu",
    "block_size": 16,
    "layout": "block_contiguous",
    "model": {
        "vocab_size": 512,
        "hidden_size": 256,
        "num_layers": 4,
        "num_heads": 8,
        "num_kv_heads": 2,
        "head_dim": 32,
        "intermediate_size": 512,
        "dtype": "float32",
        "num_params": 3.0e6,
    },
    "cost_model": {"kv_bytes_per_token": 2048, "block_size": 16},
    "step_model": {t: 1e-3 for t in ("intercept_s", "per_token_s", "per_attn_unit_s", "per_kv_token_s", "per_seq_s")},
}


@dataclass
class Row:
    argv: list[str]
    message: str  # a regular expression the one line must contain
    files: dict[str, str] = field(default_factory=dict)  # name -> contents ("/" = a directory)
    missing: tuple[str, ...] = ()


def cal(**changes) -> str:
    return json.dumps({**GOOD_CAL, **changes})


TRACE = "workload: {trace: t.jsonl}\n"
ROWS = {
    # trace
    "trace-unknown-format": Row(
        ["trace", "inspect", "t.txt", "--format", "parquet"],
        r"workload\.trace 't\.txt': unknown trace format 'parquet'; expected one of \['jsonl', 'mooncake'",
        {"t.txt": "x\n"},
    ),
    "trace-missing-file": Row(
        ["trace", "inspect", "nope.jsonl"], r"workload\.trace: file 'nope\.jsonl' does not exist"
    ),
    "trace-backwards": Row(
        ["trace", "convert", "m.jsonl", "--format", "mooncake", "--to", "jsonl", "-o", "out.jsonl"],
        r"workload\.trace 'm\.jsonl' line 2: 'timestamp' goes backwards \(1 is 8 ms before 9 on line 1\)",
        {
            "m.jsonl": '{"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
            '{"timestamp": 1, "input_length": 5, "output_length": 1, "hash_ids": [2]}\n'
        },
    ),
    "trace-bad-writer": Row(
        ["trace", "convert", "t.jsonl", "--to", "sharegpt", "-o", "out.json"],
        r"--to: cannot write format 'sharegpt'; one of \['azure', 'burstgpt', 'jsonl', 'mooncake'\]",
        {"t.jsonl": '{"arrival": 0, "prompt_len": 4, "output_len": 2}\n'},
    ),
    "trace-output-is-input": Row(
        ["trace", "sample", "t.jsonl", "--every", "2", "-o", "t.jsonl"],
        r"--output t\.jsonl: is an input of this run \('t\.jsonl'\); "
        r"an output never overwrites an input, give another path",
        {"t.jsonl": '{"arrival": 0, "prompt_len": 4, "output_len": 2}\n'},
    ),
    # demo
    "demo-bad-hash": Row(["demo", "--hash", "md5"], r"argument --hash: invalid choice: 'md5'"),
    "demo-unknown-flag": Row(["demo", "--fast"], r"unrecognized arguments: --fast"),
    # validate
    "validate-unknown-config": Row(["validate", "nope"], r"validation: no config 'nope' \(shipped: "),
    "validate-bad-point": Row(
        ["validate", "v.yaml"],
        r"validation v\.points\[0\]: give either 'published' or 'expect'",
        {"v.yaml": "points: [{id: x, metric: tpot_p50_ms, source: s}]\n"},
    ),
    "validate-without-yaml": Row(["validate"], r"needs PyYAML", missing=("yaml",)),
    "validate-runs-missing": Row(["validate", "--runs", "nope.json"], r"--runs: file 'nope\.json' does not exist"),
    # calibrate
    "calibrate-other-format": Row(
        ["calibrate", "c.yaml"], r"calibrate: 'c\.yaml' is none of the formats calibrate reads", {"c.yaml": "a: 1\n"}
    ),
    "calibrate-missing": Row(["calibrate", "nope.json"], r"calibrate: 'nope\.json' does not exist"),
    # simulate: files
    "simulate-missing-config": Row(["simulate", "nope.yaml"], r"config file 'nope.yaml' does not exist"),
    "simulate-config-is-dir": Row(["simulate", "d"], r"config: 'd' is a directory, not a file", {"d": "/"}),
    "simulate-bad-yaml": Row(["simulate", "c.yaml"], r"'c.yaml' is not valid YAML at line 2", {"c.yaml": "a: [1\n"}),
    "simulate-config-not-mapping": Row(["simulate", "c.yaml"], r"config: expected a mapping", {"c.yaml": "- 1\n"}),
    # an empty file is a mistake, not a request to run every default (the synthetic experiment)
    "simulate-empty-config": Row(
        ["simulate", "c.yaml"], r"config: 'c\.yaml' is empty; a config says what", {"c.yaml": ""}
    ),
    "simulate-comments-only-config": Row(
        ["simulate", "c.yaml"], r"config: 'c\.yaml' is empty", {"c.yaml": "# my experiment\n"}
    ),
    "simulate-empty-mapping-config": Row(["simulate", "c.yaml"], r"config: 'c\.yaml' is empty", {"c.yaml": "{}\n"}),
    "sweep-empty-config": Row(["sweep", "c.yaml"], r"config: 'c\.yaml' is empty", {"c.yaml": "\n"}),
    "simulate-bad-key": Row(
        ["simulate", "c.yaml"], r"memory\.blocksize: unknown key", {"c.yaml": "memory: {blocksize: 16}\n"}
    ),
    "simulate-nan": Row(
        ["simulate", "c.yaml"],
        r"memory\.gpu_kv_gib: must be a finite number, got nan",
        {"c.yaml": "memory: {gpu_kv_gib: .nan}\n"},
    ),
    "simulate-inf-rate": Row(
        ["simulate", "c.yaml"],
        r"workload\.arrival\.rate: must be a finite number, got inf",
        {"c.yaml": "workload: {arrival: {rate: .inf}}\n"},
    ),
    # simulate: outputs
    "simulate-json-is-dir": Row(["simulate", "fidelity-tiny", "--json", "d"], r"--json d: is a directory", {"d": "/"}),
    "simulate-json-under-file": Row(
        ["simulate", "fidelity-tiny", "--json", "f/out.json"], r"'f' is a file, not a directory", {"f": "x"}
    ),
    "simulate-plots-is-file": Row(["simulate", "fidelity-tiny", "--plots", "f"], r"--plots f: is a file", {"f": "x"}),
    # simulate: calibration
    "simulate-missing-calibration": Row(
        ["simulate", "fidelity-tiny", "--calibration", "cal.json"],
        r"calibration: file 'cal.json' does not exist \(write one with `tiered-kv crossover`\)",
    ),
    "simulate-calibration-is-dir": Row(
        ["simulate", "fidelity-tiny", "--calibration", "d"], r"calibration: 'd' is a directory", {"d": "/"}
    ),
    "simulate-calibration-not-json": Row(
        ["simulate", "fidelity-tiny", "--calibration", "c.json"], r"'c.json' is not JSON", {"c.json": "{oops"}
    ),
    "simulate-calibration-a-list": Row(
        ["simulate", "fidelity-tiny", "--calibration", "c.json"],
        r"must hold a JSON object, got list",
        {"c.json": "[1]"},
    ),
    "simulate-calibration-bad-field": Row(
        ["simulate", "fidelity-tiny", "--calibration", "c.json"],
        r"calibration\.block_size: must be an integer >= 1, got 'x'",
        {"c.json": cal(block_size="x")},
    ),
    "simulate-calibration-bad-cost-model": Row(
        ["simulate", "fidelity-tiny", "--calibration", "c.json"],
        r"calibration\.cost_model: .*kv_bytes_per_token",
        {"c.json": cal(cost_model={"block_size": 16})},
    ),
    # simulate: profiles
    "simulate-profile-bad-yaml": Row(
        ["simulate", "c.yaml"],
        r"hardware: '.*hw\.yaml' is not valid YAML",
        {"c.yaml": "hardware: hw.yaml\n", "hw.yaml": "a: [\n"},
    ),
    "simulate-profile-is-dir": Row(
        ["simulate", "c.yaml"],
        r"hardware: '.*hw\.yaml' is a directory",
        {"c.yaml": "hardware: hw.yaml\n", "hw.yaml": "/"},
    ),
    "simulate-profile-unknown": Row(
        ["simulate", "c.yaml"],
        r"no hardware profile 'gpu9' \(known: a100-80gb-pcie, .*l40s",
        {"c.yaml": "hardware: gpu9\n"},
    ),
    "simulate-profile-not-mapping": Row(
        ["simulate", "c.yaml"], r"hardware: expected a mapping", {"c.yaml": "hardware: hw.yaml\n", "hw.yaml": "- 1\n"}
    ),
    # simulate: trace fields
    "simulate-trace-missing": Row(
        ["simulate", "c.yaml"], r"workload\.trace: file '.*t\.jsonl' does not exist", {"c.yaml": TRACE}
    ),
    "simulate-trace-number-line": Row(
        ["simulate", "c.yaml"],
        r"trace '\S+t\.jsonl' line 2: expected a JSON object, got number 5",
        {"c.yaml": TRACE, "t.jsonl": '{"arrival": 0, "prompt_len": 4, "output_len": 2}\n5\n'},
    ),
    "simulate-trace-null-line": Row(
        ["simulate", "c.yaml"],
        r"trace '\S+t\.jsonl' line 1: expected a JSON object, got null",
        {"c.yaml": TRACE, "t.jsonl": "null\n"},
    ),
    "simulate-trace-text-length": Row(
        ["simulate", "c.yaml"],
        r"trace '\S+t\.jsonl' line 1: 'prompt_len' must be an integer >= 1, got string \"12\"",
        {"c.yaml": TRACE, "t.jsonl": '{"arrival": 0, "prompt_len": "12", "output_len": 2}\n'},
    ),
    "simulate-trace-text-output": Row(
        ["simulate", "c.yaml"],
        r"trace '\S+t\.jsonl' line 1: 'output_len' must be an integer >= 1, got string",
        {"c.yaml": TRACE, "t.jsonl": '{"arrival": 0, "prompt_len": 12, "output_len": "many"}\n'},
    ),
    "simulate-trace-nan-arrival": Row(
        ["simulate", "c.yaml"],
        r"trace '\S+t\.jsonl' line 1: 'arrival' must be a finite number of seconds >= 0, got nan",
        {"c.yaml": TRACE, "t.jsonl": '{"arrival": NaN, "prompt_len": 12, "output_len": 2}\n'},
    ),
    "simulate-trace-huge-prompt": Row(
        ["simulate", "c.yaml"],
        r"workload\.trace line 1: a request of 1000000002 tokens needs 62500001 GPU blocks, .* it could never run",
        {"c.yaml": TRACE, "t.jsonl": '{"arrival": 0, "prompt_len": 1e9, "output_len": 2}\n'},
    ),
    # simulate: sanity bounds
    "simulate-absurd-requests": Row(
        ["simulate", "c.yaml"],
        r"workload\.num_requests: 1000000000000 requests .* would need about [\d.]+ PiB of memory, but this machine",
        {"c.yaml": "workload: {num_requests: 1000000000000}\n"},
    ),
    "simulate-absurd-blocks": Row(
        ["simulate", "c.yaml"],
        r"memory: 1000000000 GPU \+ \d+ CPU blocks .* would need about [\d.]+ GiB of memory",
        {"c.yaml": "memory: {gpu_blocks: 1000000000}\n"},
    ),
    # simulate: extras
    "simulate-without-sim-extra": Row(
        ["simulate"], r"needs PyYAML, which is not installed: pip install 'tiered-kv\[sim\]'", missing=("yaml",)
    ),
    "simulate-plots-without-matplotlib": Row(
        ["simulate", "fidelity-tiny", "--plots", "p"],
        r"--plots needs matplotlib, .*tiered-kv\[sim\]",
        missing=("matplotlib",),
    ),
    "simulate-unknown-flag": Row(["simulate", "--turbo", "2"], r"unrecognized arguments: --turbo"),
    # sweep
    "sweep-no-config": Row(["sweep"], r"the following arguments are required: config"),
    "sweep-missing-config": Row(["sweep", "nope.yaml"], r"config file 'nope.yaml' does not exist"),
    "sweep-zero-workers": Row(
        ["sweep", "x.yaml", "--workers", "0"], r"argument --workers: expected an integer >= 1, got 0"
    ),
    "sweep-text-workers": Row(
        ["sweep", "x.yaml", "--workers", "many"], r"argument --workers: expected an integer >= 1, got 'many'"
    ),
    "sweep-workers-and-ray": Row(["sweep", "x.yaml", "--workers", "2", "--ray", "auto"], r"not allowed with argument"),
    "sweep-json-is-dir": Row(["sweep", "sweep-llama3-8b-h200", "--json", "d"], r"--json d: is a directory", {"d": "/"}),
    "sweep-bad-sweep-value": Row(
        ["sweep", "c.yaml"],
        r"sweep\.rate\[0\]: must be a finite number, got inf",
        {"c.yaml": "sweep: {rate: [.inf]}\n"},
    ),
    "sweep-without-ray": Row(
        ["sweep", "x.yaml", "--ray", "auto"],
        r"--ray needs ray, which is not installed: pip install 'tiered-kv\[ray\]'",
        missing=("ray",),
    ),
    "sweep-without-sim-extra": Row(["sweep", "x.yaml"], r"pip install 'tiered-kv\[sim\]'", missing=("yaml",)),
    # crossover
    "crossover-zero-layers": Row(["crossover", "--layers", "0"], r"argument --layers: expected an integer >= 1, got 0"),
    "crossover-block-size": Row(
        ["crossover", "--block-size", "12"], r"argument --block-size: expected a power of two, got 12"
    ),
    "crossover-dtype": Row(["crossover", "--dtype", "int4"], r"argument --dtype: invalid choice: 'int4'"),
    "crossover-heads": Row(
        ["crossover", "--heads", "8", "--kv-heads", "3"], r"--heads 8 must be a multiple of --kv-heads 3"
    ),
    "crossover-short-max-tokens": Row(["crossover", "--max-tokens", "100"], r"shortest context measured is 256 tokens"),
    "crossover-out-is-dir": Row(
        ["crossover", "--calibration-out", "d"], r"--calibration-out d: is a directory", {"d": "/"}
    ),
    "crossover-json-under-file": Row(
        ["crossover", "--json", "f/x.json"], r"'f' is a file, not a directory", {"f": "x"}
    ),
    "crossover-huge-model": Row(
        ["crossover", "--hidden", "1000000", "--layers", "100"],
        r"the model's weights alone take [\d.]+ [KMGTP]iB, more than half of this machine's",
    ),
    "crossover-without-torch": Row(
        ["crossover"], r"needs torch, which is not installed: pip install 'tiered-kv\[torch\]'", missing=("torch",)
    ),
    # fidelity
    "fidelity-missing-calibration": Row(
        ["fidelity"],
        r"calibration: file 'out/calibration\.json' does not exist \(write one with `tiered-kv crossover`\)",
    ),
    "fidelity-bad-calibration": Row(
        ["fidelity", "--calibration", "c.json"],
        r"calibration\.layout: must be one of",
        {"c.json": cal(layout="diagonal")},
    ),
    "fidelity-missing-config": Row(
        ["fidelity", "nope.yaml", "--calibration", "c.json"],
        r"config file 'nope.yaml' does not exist",
        {"c.json": cal()},
    ),
    "fidelity-json-is-dir": Row(
        ["fidelity", "--calibration", "c.json", "--json", "d"], r"--json d: is a directory", {"c.json": cal(), "d": "/"}
    ),
    "fidelity-without-torch": Row(
        ["fidelity", "--calibration", "c.json"], r"needs torch, .*tiered-kv\[torch\]", {"c.json": cal()}, ("torch",)
    ),
    "fidelity-without-sim-extra": Row(["fidelity"], r"pip install 'tiered-kv\[sim\]'", missing=("yaml",)),
    # bench-transfer
    "bench-unknown-engine": Row(
        ["bench-transfer", "--engines", "gpu"], r"argument --engines: unknown 'gpu': choose from cpu, cuda, cupy"
    ),
    "bench-block-tokens-text": Row(
        ["bench-transfer", "--block-tokens", "16,abc"], r"argument --block-tokens: expected an integer >= 1, got 'abc'"
    ),
    "bench-block-tokens-zero": Row(
        ["bench-transfer", "--block-tokens", "0"], r"argument --block-tokens: expected an integer >= 1, got 0"
    ),
    "bench-layout": Row(["bench-transfer", "--layouts", "diagonal"], r"argument --layouts: unknown 'diagonal'"),
    "bench-zero-mib": Row(["bench-transfer", "--mib", "0"], r"argument --mib: expected an integer >= 1, got 0"),
    "bench-huge-mib": Row(
        ["bench-transfer", "--mib", "100000000"], r"--mib 100000000: the tiers for one case take about"
    ),
    "bench-zero-repeats": Row(["bench-transfer", "--repeats", "0"], r"argument --repeats: expected an integer >= 1"),
    "bench-json-is-dir": Row(["bench-transfer", "--json", "d"], r"--json d: is a directory", {"d": "/"}),
    "bench-without-torch": Row(["bench-transfer"], r"needs torch, .*tiered-kv\[torch\]", missing=("torch",)),
    # gpu-check
    "gpu-check-zero-budget": Row(["gpu-check", "--budget-s", "0"], r"argument --budget-s: expected a number of sec"),
    "gpu-check-bad-part": Row(["gpu-check", "--parts", "tests,speed"], r"argument --parts: unknown 'speed'"),
    "gpu-check-out-is-file": Row(["gpu-check", "--cpu", "--out", "f"], r"--out f: is a file", {"f": "x"}),
    "gpu-check-without-torch": Row(["gpu-check", "--cpu"], r"needs torch, .*tiered-kv\[torch\]", missing=("torch",)),
}


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


if not cuda_available():  # with a GPU, --engines cuda is fine and runs
    ROWS["bench-cuda-without-gpu"] = Row(
        ["bench-transfer", "--engines", "cuda"], r"--engines cuda: needs a CUDA device"
    )
    ROWS["gpu-check-without-gpu"] = Row(["gpu-check"], r"needs a CUDA device, but .*; run `tiered-kv gpu-check --cpu`")


def test_the_table_covers_every_command():
    assert {r.argv[0] for r in ROWS.values()} == {
        "simulate",
        "sweep",
        "validate",
        "calibrate",
        "trace",
        "crossover",
        "fidelity",
        "bench-transfer",
        "gpu-check",
        "demo",
    }
    assert {m.NAME for m in COMMANDS} == {r.argv[0] for r in ROWS.values()}


@pytest.mark.parametrize("name", sorted(ROWS))
def test_bad_input_is_one_line_and_exit_status_2(name, tmp_path, monkeypatch, capsys):
    row = ROWS[name]
    for fname, text in row.files.items():
        p = tmp_path / fname
        if text == "/":
            p.mkdir()
        else:
            p.write_text(text)
    monkeypatch.chdir(tmp_path)
    for module in row.missing:
        monkeypatch.setitem(sys.modules, module, None)  # `import module` now fails as if not installed
    assert main(row.argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.endswith("\n") and err.count("\n") == 1, err
    assert err.startswith(f"tiered-kv {row.argv[0]}: "), err
    assert re.search(row.message, err), err
