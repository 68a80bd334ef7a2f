"""gpu-check's results file and time budgets.

:class:`Report` holds ``gpu-check.json`` in memory and rewrites it (to a
temporary file, then renamed over the old one) every time a part stores
something, so the file on disk is always complete, valid JSON: a run killed at
any moment leaves every part it finished and every row it measured.

:class:`Deadline` is one part's share of the time budget.  Parts look at it
between measurements and stop cleanly when it runs out, marking themselves
``partial``; a hard deadline for the whole command (:meth:`Report.arm`) ends
the process even if a measurement hangs, after writing down why.
"""

from __future__ import annotations

import copy
import datetime as dt
import json
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

#: Part statuses.  ``partial``: stopped at its time budget with some results.
STATUSES = ("pending", "running", "done", "partial", "failed", "skipped")
SCHEMA = "tiered-kv gpu-check 1"


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinity replaced by ``None``: strict JSON has neither."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def now_iso() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


class Deadline:
    """A time budget that started when it was made.

    Args:
        seconds: The budget.
        clock: Returns seconds (injectable for tests).
    """

    def __init__(self, seconds: float, clock: Any = time.monotonic) -> None:
        self.seconds = seconds
        self.clock = clock
        self.start = clock()

    @property
    def elapsed(self) -> float:
        return self.clock() - self.start

    @property
    def left(self) -> float:
        return self.seconds - self.elapsed

    def expired(self) -> bool:
        return self.left <= 0

    def fits(self, estimate_s: float) -> bool:
        """True when something expected to take ``estimate_s`` should still start."""
        return self.left >= estimate_s


class Report:
    """The results document, saved after every change.

    Args:
        path: Where ``gpu-check.json`` goes.
        header: Fields of the document's top level (form, command, budget...).
        parts: The parts' names in the order they run.
    """

    def __init__(self, path: Path, header: dict[str, Any], parts: list[str]) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.children: list[int] = []  # process groups to end with the command (the test run's child)
        self.doc: dict[str, Any] = {
            "schema": SCHEMA,
            **header,
            "started": now_iso(),
            "finished": None,
            "complete": False,
            "parts": {name: {"status": "pending"} for name in parts},
            "files": {},
        }
        self.save()

    def save(self) -> None:
        with self._lock:
            text = json.dumps(finite(self.doc), indent=1, default=str, allow_nan=False)
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text(text)
            os.replace(tmp, self.path)

    def part(self, name: str) -> dict[str, Any]:
        """A deep copy of one part's entry (what is on disk)."""
        with self._lock:
            return copy.deepcopy(self.doc["parts"][name])

    def update(self, name: str, **fields: Any) -> None:
        """Merge ``fields`` into part ``name`` and save."""
        if "status" in fields and fields["status"] not in STATUSES:
            raise ValueError(f"unknown status {fields['status']!r}")
        with self._lock:
            self.doc["parts"][name].update(copy.deepcopy(fields))
        self.save()

    def set(self, key: str, value: Any) -> None:
        """Set a top-level field and save."""
        with self._lock:
            self.doc[key] = copy.deepcopy(value)
        self.save()

    def add_file(self, role: str, path: Path) -> None:
        with self._lock:
            self.doc["files"][role] = path.name
        self.save()

    def finish(self) -> None:
        with self._lock:
            self.doc["finished"] = now_iso()
            self.doc["complete"] = all(p["status"] in ("done", "skipped") for p in self.doc["parts"].values())
        self.save()

    def arm(self, seconds: float, exit_code: int = 124) -> threading.Timer:
        """End the process after ``seconds`` even if a part hangs, recording the hard stop first."""

        def fire() -> None:
            with self._lock:
                for p in self.doc["parts"].values():
                    if p["status"] == "running":
                        p["status"] = "partial"
                        p["stopped"] = f"the whole command's hard limit of {seconds:.0f} s was reached"
                self.doc["finished"] = now_iso()
                self.doc["hard_stop"] = f"ended after {seconds:.0f} s (hard limit)"
            self.save()
            for pgid in self.children:
                try:
                    os.killpg(pgid, signal.SIGKILL)
                except OSError:  # already gone
                    pass
            os._exit(exit_code)

        timer = threading.Timer(seconds, fire)
        timer.daemon = True
        timer.start()
        return timer
