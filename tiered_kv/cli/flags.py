"""The commands' flags, declared once: value types, the flags several commands share, the checks they share.

Each type rejects a bad value with a one-line argparse error (``tiered-kv``
prints it with the command's name and ``--help``).  Each ``add_*`` helper adds
one flag that more than one command has, with the same type, metavar and
meaning everywhere; a command passes only the help text that is its own.
Importing this module imports neither torch nor PyYAML.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tiered_kv.cli.outputs import add_output, set_inputs


def positive_int(text: str) -> int:
    """An integer >= 1 (``--workers``, ``--repeats``, sizes)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (seconds, rates)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def positive_int_list(text: str) -> list[int]:
    """A comma-separated list of integers >= 1 (``16,32,64``)."""
    parts = [p.strip() for p in text.split(",")]
    if not all(parts):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 separated by commas, got {text!r}")
    return [positive_int(p) for p in parts]


def power_of_two(text: str) -> int:
    """A block size: an integer >= 1 that is a power of two."""
    value = positive_int(text)
    if value & (value - 1):
        raise argparse.ArgumentTypeError(f"expected a power of two, got {value}")
    return value


def choice_list(choices: Sequence[str]) -> Callable[[str], list[str]]:
    """A type for a comma-separated list whose items are each one of ``choices``."""

    def parse(text: str) -> list[str]:
        items = [p.strip() for p in text.split(",")]
        bad = [p for p in items if p not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {bad[0]!r}: choose from {', '.join(choices)}")
        return items

    return parse


def fraction(text: str) -> float:
    """A number in (0, 1] (a utilisation)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {v}")
    return v


def seconds(text: str) -> float:
    """A finite number of seconds > 0 (a time budget)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}") from None
    if not v > 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return v


def time_window(text: str) -> tuple[float, float]:
    """``START:END`` in seconds, ``0 <= START < END < inf``."""
    parts = text.split(":")
    try:
        a, b = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be START:END in seconds, got {text!r}") from None
    if not 0 <= a < b or b == float("inf"):
        raise argparse.ArgumentTypeError(f"must be START:END seconds with 0 <= START < END, got {text!r}")
    return a, b


def command(subparsers: Any, parents: Sequence[argparse.ArgumentParser], module: Any) -> argparse.ArgumentParser:
    """The parser of the command ``module`` defines, added to ``subparsers``.

    A command module has ``NAME``, ``SUMMARY`` (one line, for the command list),
    ``DESCRIPTION`` (for its ``--help``) and ``add_flags(parser, parents)``;
    ``run(args)`` (absent where each action has a parser of its own that sets
    it) and ``inputs(args)``, the files a run reads, which no output may
    overwrite (absent where a run reads none).  Both are read now, when the
    parser is built.
    """
    p: argparse.ArgumentParser = subparsers.add_parser(
        module.NAME, parents=parents, help=module.SUMMARY, description=module.DESCRIPTION
    )
    module.add_flags(p, parents)
    run = getattr(module, "run", None)
    if run is not None:
        p.set_defaults(func=run)
    inputs = getattr(module, "inputs", None)
    if inputs is not None:
        set_inputs(p, inputs)
    return p


def add_config(p: argparse.ArgumentParser, help: str) -> None:
    """The optional positional config: a YAML file or a shipped config's name."""
    p.add_argument("config", nargs="?", default=None, help=help)


def add_json(p: argparse.ArgumentParser, help: str) -> None:
    """``--json PATH``, an output file."""
    add_output(p, "--json", metavar="PATH", help=help)


def add_plots(p: argparse.ArgumentParser, help: str) -> None:
    """``--plots DIR``, an output directory (plots need the matplotlib extra)."""
    add_output(p, "--plots", "dir", metavar="DIR", help=help)


def add_calibration(p: Any, help: str, default: Path | None = None) -> None:
    """``--calibration PATH``, a calibration written by ``tiered-kv crossover`` (an input)."""
    p.add_argument("--calibration", type=Path, default=default, metavar="PATH", help=help)


def add_workers(p: Any, help: str) -> None:
    """``--workers N``: processes on this machine, 1 by default (the results do not depend on it)."""
    p.add_argument("--workers", type=positive_int, default=1, metavar="N", help=help)


def add_repeats(p: Any, default: int, help: str) -> None:
    """``--repeats N``: timed runs per measured point."""
    p.add_argument("--repeats", type=positive_int, default=default, metavar="N", help=help)


def add_no_progress(p: argparse.ArgumentParser, what: str = "progress bar or progress lines") -> None:
    """``--no-progress``: print no progress on stderr."""
    p.add_argument("--no-progress", action="store_true", help=f"print no {what}")


def config_inputs(config: str | None, *more: Path | None) -> list[Path]:
    """What a run of ``config`` reads (the config, its profiles and trace), then ``more`` (those not None)."""
    from tiered_kv.sim.config import input_files
    from tiered_kv.sim.extras import import_extra

    import_extra("yaml", "this command")
    return [*input_files(config), *(p for p in more if p is not None)]


def need_extras(*pairs: tuple[object, str, str]) -> None:
    """For each ``(value, module, flag)`` whose value was given, the extra ``module`` that ``flag`` needs.

    In the order given, so the first missing extra is the one named.
    """
    from tiered_kv.sim.extras import import_extra

    for value, module, flag in pairs:
        if value is not None:
            import_extra(module, flag)


def write_json(path: Path | None, doc: Any) -> None:
    """Write ``doc`` (indented JSON) to the ``--json`` path, if one was given, and say so."""
    if path is None:
        return
    from tiered_kv.sim.files import write_text

    write_text(path, json.dumps(doc, indent=1), "--json")
    print(f"wrote {path}")


def refuse_over_half_memory(need: int, what: str, advice: str) -> None:
    """Refuse, before anything is allocated, a run that needs more than half of this machine's memory.

    Raises:
        ResourceLimitError: ``"{what} {need}, more than half of this machine's {memory}; {advice}"``.
    """
    from tiered_kv.errors import ResourceLimitError
    from tiered_kv.sim.budget import Machine, human_bytes

    machine = Machine.this()
    if machine.memory_bytes is not None and need > machine.memory_bytes // 2:
        raise ResourceLimitError(
            f"{what} {human_bytes(need)}, more than half of this machine's {human_bytes(machine.memory_bytes)}; "
            f"{advice}"
        )


def here(torch: Any) -> str:
    """The device a measurement runs on: ``"cuda"`` where torch sees one, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"
