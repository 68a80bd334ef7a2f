"""gpu-check's first part: the test suite's tests marked ``gpu``, in a child process with a hard time limit.

The child is ``python -m pytest -m gpu -v`` over the checkout's ``tests/``;
its output goes to a log file next to ``gpu-check.json``, and each test's
outcome is read from the verbose lines as they appear, so a child stopped at
the time limit still reports every test that finished.  The project's own
pytest options are not used (``-o addopts=``), so a missing benchmark plugin
cannot stop the run; collection errors in unrelated modules do not stop it
either.  On a machine without CUDA every selected test skips, and the part
says so.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import tiered_kv
from tiered_kv.bench.report import Deadline

OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
# Test ids may hold spaces (parametrised messages): the outcome is the last such word before the percentage.
LINE = re.compile(r"^(?P<test>\S+::.*?)\s+(?P<outcome>" + "|".join(OUTCOMES) + r")(?P<rest>(?:\s.*)?)$")
SKIP = re.compile(r"^SKIPPED \[(?P<n>\d+)\] \S+: (?P<why>.*)$")
COLLECT = re.compile(r"^_+ ERROR collecting (?P<module>\S+) _+$")
SUMMARY = re.compile(r"^=+ (?P<summary>.*\bin [\d.]+s.*) =+$")


def tests_dir() -> Path | None:
    """The checkout's ``tests/`` beside the package, or None for an installed package."""
    d = Path(tiered_kv.__file__).resolve().parents[1] / "tests"
    return d if d.is_dir() else None


def parse(log: str) -> dict[str, Any]:
    """Outcome counts, the tests that did not pass or skip, modules that failed to import, and the summary line.

    A module that fails to import may hold gpu tests that never ran, so it
    counts against passing like a failed test.
    """
    counts: Counter[str] = Counter()
    problems: list[dict[str, str]] = []
    skipped: Counter[str] = Counter()
    collection: list[str] = []
    summary = None
    for line in log.splitlines():
        m = LINE.match(line)
        if m:
            outcome = m["outcome"]
            counts[outcome.lower()] += 1
            if outcome in ("FAILED", "ERROR", "XPASS"):
                problems.append({"test": m["test"], "outcome": outcome.lower()})
            continue
        k = SKIP.match(line)
        if k:
            skipped[k["why"]] += int(k["n"])
            continue
        c = COLLECT.match(line)
        if c:
            collection.append(c["module"])
            continue
        s = SUMMARY.match(line)
        if s:
            summary = s["summary"]
    return {
        "counts": dict(counts),
        "problems": problems,
        "skip_reasons": dict(skipped),
        "collection_errors": collection,
        "summary": summary,
    }


def _end(proc: subprocess.Popen[bytes]) -> None:
    """Stop the child's whole process group: politely, then for good."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run_gpu_tests(
    log_path: Path,
    deadline: Deadline,
    marker: str = "gpu",
    extra_args: tuple[str, ...] = (),
    children: list[int] | None = None,
) -> dict[str, Any]:
    """Run the marked tests within ``deadline``; return the parsed outcome and how the run ended.

    The child runs in its own process group, whose id is appended to
    ``children`` while it runs, so a hard stop of the whole command can end it too.
    """
    tests = tests_dir()
    if tests is None:
        return {"ran": False, "why": "no tests/ directory beside the package (run from a source checkout)"}
    root = tests.parent
    cmd = _pytest_command(marker, extra_args, tests)
    env = _child_env(root)
    t0 = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        stopped = _supervise(proc, deadline, children)
    result = parse(log_path.read_text(errors="replace"))
    result.update(
        {
            "ran": True,
            "command": " ".join(cmd[2:]),
            "returncode": proc.returncode,
            "seconds": time.monotonic() - t0,
            "stopped": stopped,
            "log": log_path.name,
        }
    )
    # pytest: 0 all passed, 1 some failed, 5 nothing collected (every test deselected).
    result["passed"] = (
        stopped is None and proc.returncode in (0, 5) and not result["problems"] and not result["collection_errors"]
    )
    return result


def _pytest_command(marker: str, extra_args: tuple[str, ...], tests: Path) -> list[str]:
    """``python -m pytest`` over ``tests`` for the marked tests, verbose, without the project's own options."""
    return [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        marker,
        "-v",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-o",
        "addopts=",
        "--continue-on-collection-errors",
        *extra_args,
        str(tests),
    ]


def _child_env(root: Path) -> dict[str, str]:
    """This environment with the checkout first on ``PYTHONPATH`` and unbuffered output, so the log is live."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _supervise(proc: subprocess.Popen[bytes], deadline: Deadline, children: list[int] | None) -> str | None:
    """Wait for the child until it ends or ``deadline`` expires; return why it was stopped, or None.

    Whatever happens (an interrupt included), the child is not left running.
    """
    if children is not None:
        children.append(proc.pid)
    stopped = None
    try:
        while proc.poll() is None:
            if deadline.expired():
                stopped = f"stopped at the part's time budget of {deadline.seconds:.0f} s"
                _end(proc)
                break
            time.sleep(0.2)
    finally:
        if proc.poll() is None:  # interrupted: never leave the child running
            _end(proc)
        if children is not None:
            children.remove(proc.pid)
    return stopped
