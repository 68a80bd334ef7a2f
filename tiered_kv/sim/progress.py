"""Progress of a long command: a bar on a terminal, plain lines in a log.

On a terminal, :class:`Progress` draws a tqdm bar (tqdm comes with the ``sim``
extra; without it, a plain ``\\r`` bar).  Where no terminal is attached (CI
logs, ``nohup``, a pipe) a bar would be one endless line or nothing at all,
so it prints a line instead, at least every ``interval_s`` seconds, with done
and total, elapsed time and an ETA::

    simulate: 1200/9000 requests (13%), 0:00:20 elapsed, ETA 0:02:10 (always-swap)

A heartbeat thread keeps those lines (and the bar's clock) coming through
phases that report nothing for a while, such as one long engine run, so a log
always shows that the command is alive.  The clock is injectable and the
heartbeat optional, so the timing rules can be tested without waiting.

The helper knows nothing about what is counted: simulate counts requests,
sweep counts cells' requests, crossover counts measurement steps.
"""

from __future__ import annotations

import io
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any, TextIO

DEFAULT_INTERVAL_S = 10.0


def clock_text(seconds: float) -> str:
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Progress:
    """Reports ``done``/``total`` of one command on a stream (stderr by default).

    Args:
        label: What is running (``"simulate"``); starts every line.
        total: Units of work in all; ``done`` goes from 0 to ``total``.
        unit: What a unit is, for people (``"requests"``).
        stream: Where to write; its ``isatty()`` decides bar or lines unless ``tty`` is given.
        enabled: False writes nothing at all (``--no-progress``).
        tty: Force terminal (True) or log (False) behaviour.
        interval_s: Off a terminal, the longest gap between two lines.
        clock: Monotonic seconds; injectable for tests.
        heartbeat: Start the thread that prints (or redraws) while nothing reports.
    """

    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "",
        *,
        stream: TextIO | None = None,
        enabled: bool = True,
        tty: bool | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: bool = True,
    ) -> None:
        self.label = label
        self.total = max(0, int(total))
        self.unit = unit
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = bool(self.stream.isatty()) if tty is None else tty
        self.interval_s = interval_s
        self.clock = clock
        self.done = 0
        self.note = ""
        self.closed = False
        self._start = clock()
        self._last_line = self._start
        self._lock = threading.Lock()
        self._bar: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not enabled:
            return
        if self.tty:
            self._bar = self._make_bar()
        else:
            self._line()
        if heartbeat:
            self._thread = threading.Thread(target=self._beat, name=f"progress:{label}", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public
    def update(self, done: int, note: str | None = None) -> None:
        """Set the number of units done (it never goes back) and, optionally, what is running now."""
        if not self.enabled or self.closed:
            return
        with self._lock:
            done = min(max(done, self.done), self.total)
            delta, self.done = done - self.done, done
            if note is not None:
                self.note = note
            if self._bar is not None:
                self._bar_update(delta, note)
            elif self.tty:
                self._draw()
            elif self.clock() - self._last_line >= self.interval_s:
                self._line()

    def advance(self, n: int = 1, note: str | None = None) -> None:
        """Count ``n`` more units done."""
        self.update(self.done + n, note)

    def tick(self) -> None:
        """Write a line if one is due (off a terminal), or redraw the bar so its clock moves."""
        if not self.enabled or self.closed:
            return
        with self._lock:
            if self._bar is not None:
                self._bar.refresh()
            elif self.tty:
                self._draw()
            elif self.clock() - self._last_line >= self.interval_s:
                self._line()

    def wrap(self, emit: Callable[[str], None]) -> Callable[[str], None]:
        """``emit`` made to print around the bar rather than through it (terminal output stays tidy)."""

        def out(text: str) -> None:
            with self._lock:
                if self._bar is not None and not self.closed:
                    self._bar.clear()
                elif self.enabled and self.tty and not self.closed:
                    self.stream.write("\r\033[K")
                emit(text)
                if self._bar is not None and not self.closed:
                    self._bar.refresh()

        return out

    def eta_s(self) -> float | None:
        """Seconds left at the average rate so far; None before the first unit."""
        elapsed = self.clock() - self._start
        if self.done <= 0 or elapsed <= 0:
            return None
        return (self.total - self.done) * elapsed / self.done

    def close(self) -> None:
        """Finish: the bar is completed, or a last line says how long it took.  Idempotent."""
        if self.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            self.closed = True
            if not self.enabled:
                return
            if self._bar is not None:
                self._bar.close()
            elif self.tty:
                self._draw()
                self.stream.write("\n")
            else:
                self._line(final=True)
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ----------------------------------------------------------------- private
    def _make_bar(self) -> Any:
        try:
            from tqdm import tqdm
        except ImportError:  # the sim extra is not installed: draw a plain bar
            self._draw()
            return None
        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
            columns = 0
        # A terminal that reports no width (a bare pty) would get a zero-width, invisible bar.
        width: dict[str, Any] = {"dynamic_ncols": True} if columns > 0 else {"ncols": 100}
        return tqdm(
            total=self.total,
            desc=self.label,
            unit=f" {self.unit}" if self.unit else "it",
            file=self.stream,
            mininterval=0.2,
            **width,
        )

    def _bar_update(self, delta: int, note: str | None) -> None:
        if note is not None:
            self._bar.set_postfix_str(note, refresh=False)
        self._bar.update(delta)

    def _status(self) -> str:
        pct = 100 * self.done // self.total if self.total else 100
        return f"{self.done}/{self.total}{' ' + self.unit if self.unit else ''} ({pct}%)"

    def _line(self, final: bool = False) -> None:
        now = self.clock()
        elapsed = clock_text(now - self._start)
        if final:
            text = f"{self.label}: {self._status()}, done in {elapsed}"
        else:
            eta = self.eta_s()
            text = f"{self.label}: {self._status()}, {elapsed} elapsed, ETA {'?' if eta is None else clock_text(eta)}"
        if self.note:
            text += f" ({self.note})"
        self.stream.write(text + "\n")
        self.stream.flush()
        self._last_line = now

    def _draw(self) -> None:
        width = 30
        fill = width * self.done // self.total if self.total else width
        eta = self.eta_s()
        self.stream.write(
            f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self._status()} "
            f"ETA {'?' if eta is None else clock_text(eta)} {self.note[:30]}"
        )
        self.stream.flush()

    def _beat(self) -> None:
        # Wake often enough that no gap between lines exceeds the interval by much.
        step = min(1.0, self.interval_s / 4)
        while not self._stop.wait(step):
            self.tick()


PhaseHook = Callable[[str, int, int], None]


class Phases:
    """A :class:`Progress` per phase of a command whose phases learn their size only when they start.

    Call it as ``phases(phase, done, total)`` (a :data:`PhaseHook`); a new phase
    closes the previous one's bar.  Crossover, for one, first measures lengths,
    then fits a step model over engine runs.
    """

    def __init__(self, label: str, unit: str = "steps", **kwargs: Any) -> None:
        self.label = label
        self.unit = unit
        self.kwargs = kwargs
        self.phase: str | None = None
        self.current: Progress | None = None

    def __call__(self, phase: str, done: int, total: int) -> None:
        if phase != self.phase or self.current is None:
            self.close()
            self.phase = phase
            self.current = Progress(f"{self.label}: {phase}", total, self.unit, **self.kwargs)
        self.current.update(done)

    def wrap(self, emit: Callable[[str], None]) -> Callable[[str], None]:
        """``emit`` made to print around whichever phase's bar is showing."""

        def out(text: str) -> None:
            if self.current is not None:
                self.current.wrap(emit)(text)
            else:
                emit(text)

        return out

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None

    def __enter__(self) -> Phases:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
