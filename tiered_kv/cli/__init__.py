"""The ``tiered-kv`` command line: the top layer, one module per command.

Each command module (``simulate``, ``sweep``, ``validate``, ``calibrate``, ``trace``,
``crossover``, ``fidelity``, ``bench_transfer``, ``gpu_check``) has ``NAME``,
``SUMMARY``, ``DESCRIPTION``, ``add_flags`` and ``run`` (see
:func:`tiered_kv.cli.flags.command`); the ``demo`` registers itself.  The flags
they share and their value types live in :mod:`tiered_kv.cli.flags`; their output options are declared and
claimed by :mod:`tiered_kv.cli.outputs`.  This module assembles the parsers,
claims every declared output before the command runs (an output is never an
input, and an unwritable one fails before any work), and turns every failure
into one line on stderr and exit status 2 (``--debug`` shows the traceback
instead).  Registering imports neither torch nor PyYAML, so ``tiered-kv
--help`` and ``--version`` work on a base install.

A new command: a module here with those names, added to ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from tiered_kv import __version__, demo
from tiered_kv.cli import bench_transfer, calibrate, crossover, fidelity, gpu_check, simulate, sweep, trace, validate
from tiered_kv.cli.flags import command
from tiered_kv.cli.outputs import claim_outputs
from tiered_kv.errors import TieredKVError

PROG = "tiered-kv"


class _Formatter(argparse.HelpFormatter):
    """Room for long flags, so most help texts start on the flag's own line."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=30)


class _TopFormatter(argparse.RawDescriptionHelpFormatter, _Formatter):
    """Keeps the command list in the epilog as written: one line per command."""


COMMANDS = (
    simulate,
    sweep,
    validate,
    calibrate,
    trace,
    crossover,
    fidelity,
    bench_transfer,
    gpu_check,
    demo,
)


class Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line: what was wrong, and where to read more."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> Parser:
    width = max(len(m.NAME) for m in COMMANDS) + 2
    listing = "\n".join(f"  {m.NAME:{width}}{m.SUMMARY}" for m in COMMANDS)
    parser = Parser(
        prog=PROG,
        usage=f"{PROG} [-h] [--version] [--debug] COMMAND ...",
        description="A multi-tier KV-cache memory manager for LLM serving: simulate it, sweep it, measure it.",
        epilog=f"commands:\n{listing}\n\nRun '{PROG} COMMAND --help' for a command's flags.",
        formatter_class=_TopFormatter,
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    parser.add_argument("--debug", action="store_true", help="on failure, show the full traceback")
    # Also accepted after the command; SUPPRESS keeps the subparser from resetting a --debug given before it.
    common = Parser(add_help=False)
    common.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="on failure, show the traceback"
    )
    # The command list is the epilog above (argparse would wrap long names onto a line of their own).
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog=PROG)
    for module in COMMANDS:
        register = getattr(module, "register", None)  # the demo registers itself beside its walk-through
        parser.commands[module.NAME] = (
            register(sub, [common]) if register is not None else command(sub, [common], module)
        )
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tiered-kv`` with ``argv`` (default: the process's arguments); return the exit status."""
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(list(sys.argv[1:] if argv is None else argv))
        if extra:  # the command's own parser says it, with its own name and --help
            parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    except SystemExit as exc:  # --help, --version, or a usage error already printed as one line
        return exc.code if isinstance(exc.code, int) else 2
    where = f"{PROG} {args.command}"
    try:
        # Every output option of every command, before the command starts (tiered_kv.cli.outputs).
        claim_outputs(args)
        return args.func(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print(f"{where}: interrupted", file=sys.stderr)
        return 130
    except TieredKVError as exc:
        if args.debug:
            raise
        print(f"{where}: {_one_line(str(exc))}", file=sys.stderr)
    except OSError as exc:
        if args.debug:
            raise
        name = f" '{exc.filename}'" if exc.filename else ""
        print(f"{where}:{name} {_one_line(exc.strerror or str(exc))}", file=sys.stderr)
    except Exception as exc:  # a bug: still one line, and the way to see more
        if args.debug:
            raise
        what = f"{type(exc).__name__}: {_one_line(str(exc))}"
        print(f"{where}: internal error: {what} (rerun with --debug for the traceback)", file=sys.stderr)
    return 2
