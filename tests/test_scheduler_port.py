"""The scheduler talks to the tier manager through the few verbs of one port, and nothing else.

Counted from the scheduler's source (ast): every member it uses on the
manager, through ``self._kv`` or a local name bound to it, is a verb of
:class:`~tiered_kv.manager.port.SchedulerPort`; it never reaches the manager
another way (``self.tm`` is only kept for drivers); the port lists at most 12.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import tiered_kv.sched.scheduler as scheduler_module
from tiered_kv.manager.port import SchedulerPort
from tiered_kv.manager.tier_manager import TierManager

SOURCE = Path(inspect.getfile(scheduler_module)).read_text()
PORT = sorted(n for n in vars(SchedulerPort) if not n.startswith("_"))


def _is_self_attr(node: ast.AST, name: str) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == name
        and isinstance(node.value, ast.Name)
        and node.value.id == "self"
    )


def members_used(source: str) -> tuple[set[str], list[int]]:
    """Members used on the port, and the lines that reach the manager in any other way (``self.tm.x``, ``tm.x``)."""
    tree = ast.parse(source)
    aliases: set[str] = set()
    for node in ast.walk(tree):  # kv = self._kv, or a, kv = x, self._kv
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (
                    zip(target.elts, node.value.elts, strict=True)
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                    else [(target, node.value)]
                )
                for t, v in pairs:
                    if isinstance(t, ast.Name) and _is_self_attr(v, "_kv"):
                        aliases.add(t.id)
    used: set[str] = set()
    other: list[int] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if _is_self_attr(v, "_kv") or (isinstance(v, ast.Name) and v.id in aliases):
            used.add(node.attr)
        elif _is_self_attr(v, "tm") or (isinstance(v, ast.Name) and v.id == "tm"):
            other.append(node.lineno)
    return used, other


def test_the_scheduler_uses_only_the_ports_verbs_and_the_port_has_at_most_12():
    used, other = members_used(SOURCE)
    assert other == [], f"the scheduler reaches the manager past its port at lines {other}"
    assert used == set(PORT), (sorted(used - set(PORT)), sorted(set(PORT) - used))
    assert len(PORT) <= 12, PORT
    assert PORT == [
        "admit",
        "free",
        "grow",
        "on_schedule_end",
        "on_tokens_computed",
        "poll",
        "preempt",
        "resume",
        "room",
        "state",
        "step_computed",
        "victim",
    ]


def test_the_tier_manager_offers_every_verb_of_the_port_with_its_parameters():
    for name in PORT:
        port_params = list(inspect.signature(getattr(SchedulerPort, name)).parameters)
        tm_params = list(inspect.signature(getattr(TierManager, name)).parameters)
        assert all(p in tm_params for p in port_params), (name, port_params, tm_params)


def test_the_count_sees_a_member_used_through_an_alias_or_past_the_port():
    used, other = members_used(
        "class S:\n    def f(self):\n        a, kv = 1, self._kv\n        kv.grow(1, 2)\n        self._kv.poll()\n"
        "        self.tm.allocate(1, 2)\n"
    )
    assert used == {"grow", "poll"} and other == [6]
