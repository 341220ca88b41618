"""The one place that checks the torch internals torch_ctrl.elastic relies on.

The agent hooks wrap private methods of torch's elastic agents and read private attributes
their ``__init__`` sets. Each is checked here against the running torch: a hook whose method
or attributes are missing is left out (torch's own behaviour stays for it), and one log line
says what was left out and why. ``python -m torch_ctrl info`` prints the same report.

=====================================  =========================================  ==========================
internal                               used for                                   without it
=====================================  =========================================  ==========================
``SimpleElasticAgent._assign_worker_    rank assignment by gather/scatter, the     torch's rank assignment;
ranks(store, group_rank,                node table (``TORCH_CTRL_HOSTS``), and     no agent group (no notice,
group_world_size, spec)``               opening the round's agent group            no collective exit barrier)
``SimpleElasticAgent._invoke_run``     closing the agent group at exit            kept open until exit
``SimpleElasticAgent._exit_barrier``   the collective exit barrier                torch's exit barrier
``LocalElasticAgent._monitor_workers`` failure notices while workers run          no notices
``LocalElasticAgent._setup_local_      round number for workers                   no TORCH_CTRL_ROUND
watchdog(envs)``
attributes ``_worker_group``,          read by the hooks above                    every hook left out
``_remaining_restarts``,
``_exit_barrier_timeout``
=====================================  =========================================  ==========================
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("torch_ctrl.elastic")

# Attributes SimpleElasticAgent.__init__ must set for any hook to work.
AGENT_ATTRIBUTES = ("_worker_group", "_remaining_restarts", "_exit_barrier_timeout")
# (class name, method, parameters after self that the hook passes on or reads)
METHODS = (
    ("SimpleElasticAgent", "_assign_worker_ranks", ("store", "group_rank", "group_world_size", "spec")),
    ("SimpleElasticAgent", "_invoke_run", ()),
    ("SimpleElasticAgent", "_exit_barrier", ()),
    ("LocalElasticAgent", "_monitor_workers", ("worker_group",)),
    ("LocalElasticAgent", "_setup_local_watchdog", ("envs",)),
)


@dataclass
class Report:
    """What the running torch offers: ``present`` and ``missing`` as ``Class.name`` strings."""

    present: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)

    def line(self) -> str:
        """One line for logs and ``info``."""
        if not self.missing:
            return f"all {len(self.present)} agent internals present"
        return f"missing in this torch: {', '.join(self.missing)}; the hooks that need them are left out"


def agent_classes() -> dict[str, type]:
    """torch's elastic agent classes, by name."""
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    return {"SimpleElasticAgent": SimpleElasticAgent, "LocalElasticAgent": LocalElasticAgent}


def _method_ok(cls: type, name: str, params: tuple[str, ...]) -> bool:
    method = getattr(cls, name, None)
    if not callable(method):
        return False
    try:
        names = list(inspect.signature(method).parameters)[1:]
    except (TypeError, ValueError):
        return False
    return names[: len(params)] == list(params)


def check() -> Report:
    """Check every internal against the running torch."""
    classes = agent_classes()
    report = Report()
    init_names = classes["SimpleElasticAgent"].__init__.__code__.co_names  # attributes it stores
    for attr in AGENT_ATTRIBUTES:
        (report.present if attr in init_names else report.missing).append(f"SimpleElasticAgent.{attr}")
    for cls_name, name, params in METHODS:
        ok = _method_ok(classes[cls_name], name, params)
        (report.present if ok else report.missing).append(f"{cls_name}.{name}")
    return report


_logged = False


def _say(report: Report, what: str) -> None:
    global _logged
    if not _logged:
        _logged = True
        log.warning("torch_ctrl: %s left out: %s", what, report.line())


def usable_hooks(table: list[tuple[type, str, Callable[..., Any]]]) -> list[tuple[type, str, Callable[..., Any]]]:
    """The entries of an agent hook table whose internals this torch has; logs once per
    process what it leaves out."""
    report = check()
    missing = set(report.missing)
    # Every hook reads the agent's attributes, and needs the round group that rank
    # assignment opens: without either, none is installed.
    if "SimpleElasticAgent._assign_worker_ranks" in missing or any(
        f"SimpleElasticAgent.{attr}" in missing for attr in AGENT_ATTRIBUTES
    ):
        _say(report, "all agent hooks")
        return []
    if missing:
        _say(report, "some agent hooks")
    return [(cls, name, hook) for cls, name, hook in table if f"{cls.__name__}.{name}" not in missing]
