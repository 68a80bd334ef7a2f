"""The benchmark client: when each request of a workload is sent to the server.

By default the load is an *open loop*: every request is sent at its own arrival time (the
arrival process's, or the trace's), whatever the server does, as ``vllm bench serve`` sends
without ``--max-concurrency``.  Two settings of the ``workload`` section close the loop, so
that what is sent depends on what the server has finished (:class:`ClientSpec`):

* ``concurrency: N`` keeps at most ``N`` requests in flight, as ``vllm bench serve
  --max-concurrency N`` does (vLLM 0.33.0, ``vllm/benchmarks/serve.py``).  There the arrival
  process runs as without the cap (``get_request`` sleeps to each request's own time and starts
  its task), and each task then waits on ``asyncio.Semaphore(N)``, whose waiters are woken first
  come, first served; the slot frees when the request function returns, after the last chunk of
  the stream has arrived.  So here: a request becomes *ready* at its arrival time, is *sent* at
  once if fewer than ``N`` are in flight, else when the longest-waiting ready request before it
  has been sent and a request finishes (its last token computed).  Its time to first token and
  end-to-end latency count from when it is sent, as vLLM's client measures them (its
  ``start_time`` is taken inside the request function, after the semaphore); the wait before is
  its *client queue* time (vLLM's ``client_queue_time``).  With ``arrival.rate: .inf`` (vLLM's
  default ``--request-rate inf``) every request is ready at 0, so exactly ``N`` are in flight
  until the workload runs out: the concurrency modes of GuideLLM and inference-perf.
* ``think_s: T`` makes each conversation a session: its next turn is ready ``T`` seconds after
  the previous turn's last token, instead of at its own arrival time (its first turn, at its own
  arrival time).  The turns of a conversation are its requests in the workload, in turn order;
  a turn whose earlier turns a sample dropped starts the session.

Both apply to synthetic and replayed workloads alike, with a trace's conversations as
:mod:`tiered_kv.sim.trace_formats` reads them.  Everything is deterministic: requests ready at
the same time are taken in workload order, and a follow-up ready at the same time as a
request the workload already had goes after it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

from tiered_kv.sim.events import EventLoop
from tiered_kv.sim.workload import SimRequest, scale_text

#: The event kind of a request becoming ready to send (payload: the request).
READY = "ready"


@dataclass(frozen=True, slots=True)
class ClientSpec:
    """How the client sends: ``concurrency`` (None: no cap) and ``think_s`` (None: turns at their own times)."""

    concurrency: int | None = None
    think_s: float | None = None

    @property
    def open_loop(self) -> bool:
        """Every request sent at its own arrival time (neither setting given)."""
        return self.concurrency is None and self.think_s is None

    def describe(self) -> str:
        """What the run's first line says of the client (``""`` for the open loop)."""
        parts = []
        if self.concurrency is not None:
            parts.append(f"at most {self.concurrency} request{'s' if self.concurrency != 1 else ''} in flight")
        if self.think_s is not None:
            parts.append(f"each conversation's next turn {self.think_s:g} s after its previous answer")
        return ", ".join(parts)


OPEN_LOOP = ClientSpec()


def describe_load(spec: dict[str, Any]) -> str:
    """How a validated ``workload`` section's requests are timed and sent, for the run's first line.

    ``""`` for the default: an open loop, at the workload's own times.
    """
    parts = (scale_text(spec), ClientSpec(spec["concurrency"], spec["think_s"]).describe())
    return "; ".join(p for p in parts if p)


class Client:
    """Sends a workload's requests on a simulator's event loop, as a :class:`ClientSpec` says.

    The simulator calls :meth:`start` once, :meth:`ready` for each :data:`READY` event and
    :meth:`finished` when a request's last token is computed; the client schedules an
    ``"arrival"`` event, the request reaching the scheduler ``frontend_s`` after it is sent,
    for each request it sends.  A sent request is a copy whose ``arrival`` is the time it was
    sent and whose ``queued`` is how long it waited for a slot; the workload is left as it was
    (the runs of one regime share it).

    Invariant: at most ``concurrency`` requests are in flight (sent and not finished), and a
    request waits only while that many are.
    """

    __slots__ = ("front", "in_flight", "limit", "loop", "next_turn", "think", "waiting", "workload")

    def __init__(self, spec: ClientSpec, workload: list[SimRequest], loop: EventLoop, frontend_s: float) -> None:
        self.limit: float = spec.concurrency if spec.concurrency is not None else math.inf
        self.think = spec.think_s
        self.loop = loop
        self.front = frontend_s
        self.workload = workload
        self.in_flight = 0
        self.waiting: deque[tuple[float, SimRequest]] = deque()  # (ready at, request), first ready first
        self.next_turn: dict[int, SimRequest] = {}  # rid -> the turn its answer makes ready
        if self.think is not None:
            turns: dict[int, list[SimRequest]] = {}
            for r in workload:
                if r.conversation >= 0:
                    turns.setdefault(r.conversation, []).append(r)
            for conv in turns.values():
                conv.sort(key=lambda r: r.turn)  # stable: equal turns stay in workload order
                for prev, nxt in pairwise(conv):
                    self.next_turn[prev.rid] = nxt

    def start(self) -> None:
        """Schedule every request that is ready at its own arrival time (all but the sessions' later turns)."""
        later = {r.rid for r in self.next_turn.values()}
        for r in self.workload:
            if r.rid not in later:
                self.loop.schedule(r.arrival, READY, r)

    def ready(self, r: SimRequest, t: float) -> None:
        """``r`` is ready at ``t``: send it now if a slot is free, else queue it."""
        if self.in_flight < self.limit:  # then nothing waits: a freed slot is taken at once
            self._send(r, t, t)
        else:
            self.waiting.append((t, r))

    def finished(self, rid: int, t: float) -> None:
        """Request ``rid`` got its last token at ``t``: its slot goes to the longest-waiting request."""
        self.in_flight -= 1
        nxt = self.next_turn.pop(rid, None)
        if nxt is not None:
            self.loop.schedule(t + self.think, READY, nxt)  # type: ignore[operator]  # think is set when a turn follows
        while self.waiting and self.in_flight < self.limit:
            since, r = self.waiting.popleft()
            self._send(r, since, t)

    def _send(self, r: SimRequest, since: float, t: float) -> None:
        self.in_flight += 1
        self.loop.schedule(t + self.front, "arrival", replace(r, arrival=t, queued=t - since))
