"""Every command's output options: declared once, checked against the run's inputs, and created before it starts.

A command declares each output option with :func:`add_output` (a file or a
directory) and what it reads with :func:`set_inputs`; ``tiered-kv`` calls
:func:`claim_outputs` before the command runs, so a new subcommand gets the same
guarantees by declaring its options, with no check of its own:

* **an output is never an input**: a path that resolves to a file the run
  reads (the config, a profile, the workload trace, a calibration) is refused,
  as are two outputs that resolve to the same path; ``simulate --json
  workload.jsonl`` would otherwise overwrite the trace it replays;
* **an unwritable output fails before the first step**: each file is actually
  created (an existing one is opened for appending, which changes nothing) and
  each directory created with a probe file in it; what did not exist before is
  then removed again, so a refused or failed run leaves nothing behind.
  Checking permissions alone is not enough: ``/proc/x.json`` passes
  ``os.access`` as root, and a full run used to end in "cannot write".
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from tiered_kv.errors import OutputError
from tiered_kv.sim.files import check_output_dir, check_output_file

OUTPUTS = "_tiered_kv_outputs"  # argparse default holding a parser's declared outputs
INPUTS = "_tiered_kv_inputs"  # argparse default holding the function that lists a run's input files
Kind = Literal["file", "dir"]


@dataclass(frozen=True, slots=True)
class Output:
    """One output option: its flag, its argparse destination, a file or a directory.

    ``resolve`` gives the path when the option's value alone does not (crossover's
    ``--rows`` defaults to a name beside ``--calibration-out``).
    """

    flag: str
    dest: str
    kind: Kind
    resolve: Callable[[argparse.Namespace], Path | None] | None = None

    def path(self, args: argparse.Namespace) -> Path | None:
        if self.resolve is not None:
            return self.resolve(args)
        value = getattr(args, self.dest, None)
        return Path(value) if value is not None else None


def add_output(
    parser: argparse.ArgumentParser,
    flag: str,
    kind: Kind = "file",
    resolve: Callable[[argparse.Namespace], Path | None] | None = None,
    aliases: Sequence[str] = (),
    **kwargs: Any,
) -> None:
    """Add an output option (``type=Path``) to ``parser`` and declare it for :func:`claim_outputs`.

    ``flag`` is the name errors give; ``aliases`` are other spellings of it (``-o`` for
    ``--output``).  ``kwargs`` go to ``add_argument`` (``help``, ``metavar``, ``default``).
    """
    action = parser.add_argument(*aliases, flag, type=Path, **kwargs)
    declared = parser.get_default(OUTPUTS) or ()
    parser.set_defaults(**{OUTPUTS: (*declared, Output(flag, action.dest, kind, resolve))})


def set_inputs(parser: argparse.ArgumentParser, inputs: Callable[[argparse.Namespace], Iterable[Path]]) -> None:
    """Declare the files a run of this command reads (given its parsed arguments); none by default."""
    parser.set_defaults(**{INPUTS: inputs})


def declared_outputs(parser: argparse.ArgumentParser) -> tuple[Output, ...]:
    """The output options declared on a command's parser."""
    return tuple(parser.get_default(OUTPUTS) or ())


def _same(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)  # hard links, bind mounts
    except OSError:
        return False


def _oneline(exc: OSError) -> str:
    return exc.strerror or " ".join(str(exc).split())


def _missing_parents(path: Path) -> list[Path]:
    """The ancestors of ``path`` that do not exist, nearest the root first."""
    out = []
    parent = path.parent
    while not parent.exists() and parent.parent != parent:
        out.append(parent)
        parent = parent.parent
    return out[::-1]


def _remove(paths: Iterable[Path]) -> None:
    for p in sorted(paths, key=lambda p: len(p.parts), reverse=True):
        try:
            p.rmdir() if p.is_dir() else p.unlink()
        except OSError:
            pass  # left behind is better than failing the check that found the path writable


def _try_create(flag: str, path: Path, kind: Kind) -> None:
    """Create ``path`` (and its missing parents) for real, then remove what did not exist before."""
    created: list[Path] = []
    try:
        for parent in _missing_parents(path if kind == "file" else path / "x"):
            parent.mkdir()
            created.append(parent)
        if kind == "file":
            if path.exists():
                with open(path, "ab"):  # proves it can be written, and changes nothing
                    pass
            else:
                with open(path, "xb"):
                    pass
                created.append(path)
        else:
            fd, probe = tempfile.mkstemp(dir=path, prefix=".tiered-kv-probe-")
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        what = "the file" if kind == "file" else "a file in the directory"
        raise OutputError(f"{flag} {path}: cannot create {what} ({_oneline(exc)})") from None
    finally:
        _remove(created)


def claim_outputs(args: argparse.Namespace) -> None:
    """Refuse an output that is an input or another output, then create and remove every output; before any work.

    Raises:
        OutputError: naming the flag and the path; nothing is left on disk.
    """
    outputs = [(o, o.path(args)) for o in getattr(args, OUTPUTS, ())]
    given = [(o, p) for o, p in outputs if p is not None]
    if not given:
        return
    inputs_of = getattr(args, INPUTS, None)
    inputs = [Path(p) for p in inputs_of(args)] if inputs_of is not None else []
    for o, path in given:
        for inp in inputs:
            if _same(path, inp):
                raise OutputError(
                    f"{o.flag} {path}: is an input of this run ('{inp}'); an output never overwrites an input, "
                    "give another path"
                )
    for k, (o, path) in enumerate(given):
        for o2, path2 in given[:k]:
            if _same(path, path2):
                raise OutputError(f"{o.flag} {path}: is also the path of {o2.flag}; give each output its own path")
    for o, path in given:
        (check_output_file if o.kind == "file" else check_output_dir)(path, o.flag)
    for o, path in given:
        _try_create(o.flag, path, o.kind)
