"""Every output option of every command: never an input of the run, and created (then removed) before any work.

``simulate --trace PATH`` used to overwrite the workload trace when PATH was
the config's ``workload.trace``, and ``simulate --json /proc/x.json`` ran the
whole experiment before finding it could not write.  The outputs are declared
once per command (``tiered_kv.cli.outputs.add_output``) and claimed by
``tiered-kv`` before the command starts, so these tests walk every command's
declared outputs rather than a list kept by hand.
"""

import argparse
import copy
import json
import os
import re
from pathlib import Path

import pytest
import yaml
from simutil import TINY

from tiered_kv.cli import COMMANDS, build_parser, main
from tiered_kv.cli.outputs import declared_outputs

TRACE_ROWS = "".join(json.dumps({"arrival": t, "prompt_len": 4, "output_len": 2}) + "\n" for t in (0, 1))
# A path no one can create a file or directory in, root included (os.access says yes there, as root).
UNWRITABLE = "/proc/tiered-kv-test/out"
# The options of type Path that are inputs, not outputs; any other Path option must be a declared output.
INPUT_OPTIONS = {
    ("simulate", "--calibration"),
    ("crossover", "--calibration"),
    ("fidelity", "--calibration"),
    ("validate", "--runs"),
    ("calibrate", "measurements"),
    ("trace inspect", "path"),
    ("trace convert", "path"),
    ("trace sample", "path"),
}
# The least each command needs on its command line (its outputs are claimed before anything else runs).
ARGV = {
    "simulate": ["simulate", "c.yaml", "--no-progress"],
    "sweep": ["sweep", "c.yaml", "--no-progress"],
    "validate": ["validate", "v.yaml", "--no-progress"],
    "calibrate": ["calibrate", "runs.yaml", "--no-progress"],
    "crossover": ["crossover", "--no-progress"],
    "fidelity": ["fidelity", "c.yaml", "--calibration", "cal.json", "--no-progress"],
    "bench-transfer": ["bench-transfer"],
    "gpu-check": ["gpu-check", "--cpu"],
    "trace inspect": ["trace", "inspect", "t.jsonl"],
    "trace convert": ["trace", "convert", "t.jsonl", "--to", "jsonl"],
    "trace sample": ["trace", "sample", "t.jsonl", "--every", "2"],
}


def commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, and for a command with actions (``trace``) each action's parser instead."""
    out: dict[str, argparse.ArgumentParser] = {}
    for name, parser in build_parser().commands.items():
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions:
            out[name] = parser
        for sub in actions:
            out.update({f"{name} {action}": p for action, p in sub.choices.items()})
    return out


def every_output() -> list[tuple[str, str, str]]:
    return [(name, o.flag, o.kind) for name, p in commands().items() for o in declared_outputs(p)]


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A directory with a tiny config that replays a two-request trace, and its profile files."""
    raw = copy.deepcopy(TINY)
    raw["hardware"], raw["model"] = "hw.yaml", "model.yaml"
    raw["workload"] = {"trace": "t.jsonl"}
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(TINY["hardware"]))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump(TINY["model"]))
    (tmp_path / "t.jsonl").write_text(TRACE_ROWS)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def snapshot(d: Path) -> dict[str, bytes]:
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_every_path_option_of_every_command_is_a_declared_output_or_a_known_input():
    for name, parser in commands().items():
        declared = {o.flag for o in declared_outputs(parser)}
        for action in parser._actions:
            if action.type is Path:
                flag = action.option_strings[-1] if action.option_strings else action.dest  # --output, not -o
                assert flag in declared or (name, flag) in INPUT_OPTIONS, f"{name} {flag}: declare it with add_output"
    assert {m.NAME for m in COMMANDS} - {"demo"} == {name.split()[0] for name in ARGV}
    assert set(commands()) - {"demo"} == set(ARGV)


def test_the_timeline_option_is_named_for_what_it_writes(run_dir, capsys):
    assert main(["simulate", "c.yaml", "--trace", "out.json"]) == 2
    err = capsys.readouterr().err
    assert "--trace is now --timeline (it writes a timeline of the run; the workload trace is an input)" in err
    assert "--timeline" in {o.flag for o in declared_outputs(commands()["simulate"])}


@pytest.mark.parametrize(
    "spelling", ["t.jsonl", "./t.jsonl", "sub/../t.jsonl", "{abs}/t.jsonl", "link.jsonl"], ids=lambda s: s
)
def test_simulate_never_overwrites_its_workload_trace(run_dir, capsys, spelling):
    (run_dir / "sub").mkdir()
    os.symlink(run_dir / "t.jsonl", run_dir / "link.jsonl")
    before = snapshot(run_dir)
    path = spelling.format(abs=run_dir)
    assert main(["simulate", "c.yaml", "--no-progress", "--timeline", path]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # refused before anything ran
    assert re.fullmatch(
        rf"tiered-kv simulate: --timeline {re.escape(str(Path(path)))}: is an input of this run \('.*t\.jsonl'\); "
        r"an output never overwrites an input, give another path\n",
        err,
    ), err
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("flag", ["--json", "--requests", "--timeline", "--metrics", "--plots"])
@pytest.mark.parametrize("target", ["c.yaml", "hw.yaml", "model.yaml", "t.jsonl", "cal.json"])
def test_no_output_of_simulate_is_any_of_its_inputs(run_dir, capsys, flag, target):
    (run_dir / "cal.json").write_text("{}")
    argv = ["simulate", "c.yaml", "--no-progress", flag, target]
    if target == "cal.json":
        argv += ["--calibration", "cal.json"]
    before = snapshot(run_dir)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} {target}: is an input of this run" in err, err
    assert snapshot(run_dir) == before


def test_a_shipped_profile_a_config_names_is_an_input_too(run_dir, capsys):
    from tiered_kv.sim.shipped import shipped

    h200 = shipped("hardware", "h200")
    before = h200.read_bytes()
    raw = yaml.safe_load((run_dir / "c.yaml").read_text())
    (run_dir / "c.yaml").write_text(yaml.safe_dump(dict(raw, hardware="h200")))
    assert main(["simulate", "c.yaml", "--json", str(h200)]) == 2
    assert "is an input of this run" in capsys.readouterr().err
    assert h200.read_bytes() == before


@pytest.mark.parametrize(
    ("argv", "flag", "target"),
    [
        (["sweep", "c.yaml"], "--json", "c.yaml"),
        (["sweep", "c.yaml"], "--json", "t.jsonl"),
        (["validate", "v.yaml"], "--json", "v.yaml"),
        (["validate", "v.yaml"], "--json", "hw.yaml"),
        (["validate", "--only-runs", "--runs", "runs.yaml"], "--json", "runs.yaml"),
        (["calibrate", "runs.yaml"], "--out", "runs.yaml"),
        (["calibrate", "runs.yaml", "--hardware", "hw.yaml"], "--out", "hw.yaml"),
        (["calibrate", "runs.yaml"], "--plot", "runs.yaml"),
        (["fidelity", "c.yaml", "--calibration", "cal.json"], "--json", "cal.json"),
        (["fidelity", "c.yaml", "--calibration", "cal.json"], "--json", "t.jsonl"),
        (["crossover", "--model", "model.yaml", "--hardware", "hw.yaml"], "--json", "hw.yaml"),
        (["crossover", "--model", "model.yaml", "--hardware", "hw.yaml"], "--calibration-out", "model.yaml"),
        (["crossover", "--model", "model.yaml", "--calibration", "cal.json"], "--rows", "cal.json"),
        (["trace", "inspect", "t.jsonl"], "--json", "t.jsonl"),
        (["trace", "convert", "t.jsonl", "--to", "jsonl"], "--output", "t.jsonl"),
        (["trace", "sample", "t.jsonl", "--every", "2"], "--output", "sub/../t.jsonl"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else v,
)
def test_no_output_of_any_command_is_one_of_its_inputs(run_dir, capsys, argv, flag, target):
    (run_dir / "cal.json").write_text("{}")
    (run_dir / "v.yaml").write_text("hardware: hw.yaml\npoints: []\n")
    before = snapshot(run_dir)
    assert main([*argv, flag, target]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {target}: is an input of this run" in err, err
    assert snapshot(run_dir) == before


def test_an_output_spelled_by_its_alias_is_refused_under_its_name(run_dir, capsys):
    before = snapshot(run_dir)
    assert main(["trace", "sample", "t.jsonl", "-o", str(run_dir / "t.jsonl")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"tiered-kv trace: --output {run_dir / 't.jsonl'}: is an input of this run ('t.jsonl'); "
        "an output never overwrites an input, give another path\n"
    )
    assert snapshot(run_dir) == before


def test_two_outputs_may_not_share_a_path(run_dir, capsys):
    assert main(["simulate", "c.yaml", "--json", "out/r.json", "--requests", "./out/r.json"]) == 2
    err = capsys.readouterr().err
    assert "--requests out/r.json: is also the path of --json; give each output its own path" in err
    assert not (run_dir / "out").exists()


def test_simulate_json_in_proc_fails_before_the_first_step(run_dir, capsys):
    """The issue's case: the whole experiment ran, then the write failed."""
    assert main(["simulate", "c.yaml", "--no-progress", "--json", "/proc/x.json"]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # no header, no table: nothing was simulated
    assert re.fullmatch(r"tiered-kv simulate: --json /proc/x\.json: cannot create the file \(.+\)\n", err), err


@pytest.mark.parametrize(("command", "flag", "kind"), every_output(), ids=lambda v: v)
def test_every_output_of_every_command_is_created_before_the_command_runs(run_dir, capsys, command, flag, kind):
    (run_dir / "cal.json").write_text("{}")
    before = snapshot(run_dir)
    assert main([*ARGV[command], flag, UNWRITABLE]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    what = "the file" if kind == "file" else "a file in the directory"
    where = command.split()[0]  # errors name the command, not its action
    assert re.fullmatch(rf"tiered-kv {where}: {flag} {re.escape(UNWRITABLE)}: cannot create {what} \(.+\)\n", err), err
    assert snapshot(run_dir) == before


def test_what_the_check_created_is_gone_when_the_run_then_fails(run_dir, capsys):
    raw = yaml.safe_load((run_dir / "c.yaml").read_text())
    (run_dir / "c.yaml").write_text(yaml.safe_dump(dict(raw, memory={"blocksize": 16})))
    (run_dir / "old.json").write_text("keep me")
    argv = ["simulate", "c.yaml", "--json", "new/deep/r.json", "--plots", "plots/here", "--requests", "old.json"]
    assert main(argv) == 2
    assert "memory.blocksize: unknown key" in capsys.readouterr().err
    assert not (run_dir / "new").exists() and not (run_dir / "plots").exists()
    assert (run_dir / "old.json").read_text() == "keep me"  # opened to prove it writable, never truncated


def test_a_claimed_run_writes_every_output(run_dir, capsys):
    argv = ["simulate", "c.yaml", "--no-progress", "--json", "o/r.json", "--timeline", "o/tl.json"]
    assert main([*argv, "--requests", "o/req.jsonl"]) == 0
    assert json.loads((run_dir / "o/tl.json").read_text())["traceEvents"]
    assert json.loads((run_dir / "o/r.json").read_text())["runs"][0]["run"] == "only"
    assert len((run_dir / "o/req.jsonl").read_text().splitlines()) == 2
    assert (run_dir / "t.jsonl").read_text() == TRACE_ROWS
