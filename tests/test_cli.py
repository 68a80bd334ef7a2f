"""The command line's shape: one parser per command, help on every flag, --version, --debug."""

import re
import subprocess
import sys
from importlib.metadata import version

import pytest

import tiered_kv
from tiered_kv.cli import COMMANDS, main
from tiered_kv.errors import ConfigError

NAMES = [m.NAME for m in COMMANDS]


def test_commands_are_the_documented_ten():
    assert NAMES == [
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
    ]


def test_help_lists_every_command_with_its_summary_on_one_line(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tiered-kv [-h] [--version] [--debug] COMMAND ...")
    for m in COMMANDS:
        assert re.search(rf"^  {re.escape(m.NAME)} +{re.escape(m.SUMMARY)}$", out, re.M), m.NAME


def option_entries(help_text: str) -> dict[str, str]:
    """Each flag or positional of a --help text mapped to its help text (argparse's layout)."""
    entries: dict[str, str] = {}
    current = None
    for line in help_text.splitlines():
        m = re.match(r"^  (\S.*?)(?:  +(\S.*))?$", line)
        if m and not line.startswith("   "):
            current = m.group(1)
            entries[current] = m.group(2) or ""
        elif current is not None and line.startswith("    ") and line.strip():
            entries[current] = (entries[current] + " " + line.strip()).strip()
        elif not line.strip() or not line.startswith(" "):
            current = None
    return entries


@pytest.mark.parametrize("name", NAMES)
def test_every_flag_of_every_command_has_help_text(name, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main([name, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: tiered-kv {name} ")
    entries = option_entries(out)
    assert "-h, --help" in entries and "--debug" in entries
    for flag, text in entries.items():
        assert len(text) > 10, f"{name} {flag} has no help text"


def test_the_help_checker_sees_a_flag_without_help():
    text = "options:\n  -h, --help   show this help message and exit\n  --bare\n  --x X        an x\n"
    assert option_entries(text) == {"-h, --help": "show this help message and exit", "--bare": "", "--x X": "an x"}


def test_version_is_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tiered-kv {tiered_kv.__version__}"
    assert version("tiered-kv") == tiered_kv.__version__


def test_help_and_version_import_neither_torch_nor_yaml():
    code = (
        "import sys\n"
        "from tiered_kv.cli import main\n"
        "for argv in (['--help'], ['--version'], *[[n, '--help'] for n in " + repr(NAMES) + "]):\n"
        "    assert main(argv) == 0, argv\n"
        "heavy = sorted(m for m in ('torch', 'yaml', 'matplotlib', 'ray', 'tqdm') if m in sys.modules)\n"
        "print('HEAVY', heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "HEAVY []" in out


def test_debug_shows_the_traceback_before_or_after_the_command(tmp_path):
    missing = str(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        main(["--debug", "simulate", missing])
    with pytest.raises(ConfigError, match="does not exist"):
        main(["simulate", missing, "--debug"])


def test_failure_in_a_real_process_is_one_line_and_status_2(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "tiered_kv.cli", "simulate", str(tmp_path)], capture_output=True, text=True
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "is a directory" in r.stderr and "Traceback" not in r.stderr


def test_an_unexpected_error_is_still_one_line(monkeypatch, capsys):
    from tiered_kv.cli import simulate as simulate_cmd

    def broken(args):
        raise RuntimeError("something\nbroke")

    monkeypatch.setattr(simulate_cmd, "run", broken)
    # The parser binds run at build time, so rebuild it after the patch.
    assert main(["simulate", "x.yaml"]) == 2
    err = capsys.readouterr().err
    assert (
        err
        == "tiered-kv simulate: internal error: RuntimeError: something broke (rerun with --debug for the traceback)\n"
    )
