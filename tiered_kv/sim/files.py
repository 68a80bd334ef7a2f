"""The user's files: read inputs and write outputs, failing with one line that names the file and the key.

Inputs (configs, profiles, traces, calibrations) raise
:class:`~tiered_kv.errors.ConfigError`; outputs (``--json``, ``--plots``)
raise :class:`~tiered_kv.errors.OutputError`.  The checks here are the first
half of claiming an output; :mod:`tiered_kv.cli.outputs` then creates it for
real before any command runs, so a typo in ``--json`` costs nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tiered_kv.errors import ConfigError, OutputError
from tiered_kv.sim.extras import import_extra

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable


def _oneline(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def read_text(path: Path | Traversable, what: str) -> str:
    """The text of an input file; ``what`` names it in errors (``"workload.trace"``, ``"calibration"``)."""
    if isinstance(path, Path):
        if not path.exists():
            raise ConfigError(f"{what}: file '{path}' does not exist")
        if path.is_dir():
            raise ConfigError(f"{what}: '{path}' is a directory, not a file")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{what}: '{path}' is not UTF-8 text") from None
    except OSError as exc:
        raise ConfigError(f"{what}: cannot read '{path}' ({exc.strerror or _oneline(exc)})") from None


def read_yaml(path: Path | Traversable, what: str) -> Any:
    """Parse a YAML input file (needs the ``sim`` extra)."""
    yaml = import_extra("yaml", "reading YAML configs")
    text = read_text(path, what)
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or _oneline(exc)
        raise ConfigError(f"{what}: '{path}' is not valid YAML{where}: {problem}") from None


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON input file."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{what}: '{path}' is not JSON ({exc})") from None


def _writable_ancestor(path: Path, what: str) -> None:
    """The nearest existing ancestor of ``path`` must be a directory we may write into."""
    parent = path.parent
    while not parent.exists():
        if parent.parent == parent:
            break
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{what} {path}: '{parent}' is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: no permission to write in '{parent}'")


def check_output_file(path: Path, what: str) -> None:
    """Fail now if ``path`` could not be written as a file later (``what`` is the flag, e.g. ``--json``)."""
    if path.is_dir():
        raise OutputError(f"{what} {path}: is a directory; give a file path")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputError(f"{what} {path}: no permission to overwrite it")
    _writable_ancestor(path, what)


def check_output_dir(path: Path, what: str) -> None:
    """Fail now if ``path`` could not be created or written as a directory later."""
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path}: is a file; give a directory")
    if path.is_dir() and not os.access(path, os.W_OK | os.X_OK):
        raise OutputError(f"{what} {path}: no permission to write in it")
    _writable_ancestor(path, what)


def write_text(path: Path, text: str, what: str = "output") -> None:
    """Create the parent directories and write ``text``; any OS failure becomes one OutputError line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    except OSError as exc:
        raise OutputError(f"{what} {path}: cannot write ({exc.strerror or _oneline(exc)})") from None


def make_dir(path: Path, what: str = "output") -> Path:
    """Create an output directory (and its parents); any OS failure becomes one OutputError line."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"{what} {path}: cannot create the directory ({exc.strerror or _oneline(exc)})") from None
    return path
