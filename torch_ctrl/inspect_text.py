"""Human-readable text of an inspection report (:func:`torch_ctrl.inspection.inspect`).

Long rank lists are folded like the error messages (the first 16, then ``and N more``), and
a group lists at most :data:`MAX_OPS` ops in flight (the JSON report has them all).
"""

from __future__ import annotations

from typing import Any

from .errors import format_ranks
from .inspection import KEEP_ALIVE_DEAD_AFTER

MAX_OPS = 20


def _secs(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}s"


def _group_title(g: dict[str, Any]) -> str:
    ns = g["namespace"]
    kind = ns.get("kind")
    if kind == "agents":
        where = f"torchrun agents, run {ns['run_id']!r} round {ns['round']}"
    elif kind == "workers":
        run = f"run {ns['run_id']!r}" if ns.get("run_id") else "outside torchrun"
        step = f" round {ns['round']}" if "round" in ns else (f" restart {ns['restart']}" if "restart" in ns else "")
        where = f"torchrun workers (from_env), {run}{step}"
    elif kind == "plain":
        where = "no prefix"
    else:
        where = f"prefix {g['prefix']!r}"
    store = f" on {g['store']}" if g.get("store") else ""
    return f"group of {g['world_size']} ranks ({where}){store}"


def _op_line(op: dict[str, Any]) -> str:
    kind = " or ".join(op["candidates"]) if len(op["candidates"]) > 1 else op["op"]
    parts = [f"{kind} {op['key']!r}"]
    if op.get("arrived") is not None:
        parts.append(f"{op['arrived']}/{op['world_size']} arrived")
    if op.get("aborted"):
        parts.append("ABORTED")
    if op.get("detail"):
        parts.append(op["detail"])
    if op["blocked"]:
        parts.append(f"blocked: {format_ranks(op['blocked'])}")
    if op.get("missing"):
        if op.get("unnamed"):
            text = f"missing or not named yet: {format_ranks(op['missing'])} ({op['unnamed']} of them arrived)"
        else:
            text = f"missing: {format_ranks(op['missing'])}"
        parts.append(text)
    if op.get("slots"):
        parts.append(f"slots: {format_ranks(op['slots'])}")
    if op.get("other_world_sizes"):
        sizes = ", ".join(map(str, op["other_world_sizes"]))
        parts.append(f"also in flight with world_size {sizes}: ranks given different world sizes?")
    pending = f"seen pending {_secs(op['pending_s'])}"
    if op["pending_s"] > 0:
        pending += (
            ", no progress" if op["unchanged_s"] >= op["pending_s"] else f", changed {_secs(op['unchanged_s'])} ago"
        )
    parts.append(pending)
    return "; ".join(parts)


def _heartbeat_lines(hb: dict[str, Any], world: int) -> list[str]:
    ranks = hb["ranks"]
    declared = sorted({r["interval_s"] for r in ranks if r.get("interval_s")})
    if declared:  # what the ranks wrote in their counters
        span = f"{declared[0]:.3g}s" if len(declared) == 1 else f"{declared[0]:.3g}-{declared[-1]:.3g}s"
        interval = f" (interval {span})"
    else:
        interval = f" (interval ~{hb['estimated_interval_s']:.2g}s)" if hb.get("estimated_interval_s") else ""
    by_status: dict[str, list[dict[str, Any]]] = {}
    for r in ranks:
        by_status.setdefault(r["status"], []).append(r)
    if hb.get("window_s") is None:
        lines = [f"heartbeats{interval}: {len(ranks)}/{world} ranks have a counter (one sample: ages unknown)"]
    else:
        # A stopped or late rank is not counted as beating: only counters seen moving are.
        parts = [f"{len(by_status.get('ok', []))}/{world} ranks beating"]
        for status, text in (("stopped", "STOPPED"), ("late", "late"), ("unknown", "not seen beating yet")):
            if by_status.get(status):
                parts.append(f"{len(by_status[status])} {text}")
        lines = [f"heartbeats{interval}: over {_secs(hb.get('observed_s', hb['window_s']))}, {', '.join(parts)}"]
    if hb["stopped"]:
        lines.append(f"  STOPPED: {format_ranks(hb['stopped'])}")
        for r in by_status.get("stopped", [])[:16]:
            if r.get("interval_s"):
                why = f"{r['age_s'] / r['interval_s']:.3g} of its {r['interval_s']:.3g}s intervals"
            else:
                why = f"while others beat {r['others_beats_since']} times"
            lines.append(f"    rank {r['rank']}: no beat for {_secs(r['age_s'])} or more, {why}")
    late = by_status.get("late", [])
    slow = [r["rank"] for r in late if r.get("interval_s")]
    if slow:
        lines.append(f"  late (no beat for over 1.5 of its intervals): {format_ranks(slow)}")
    undeclared = [r["rank"] for r in late if not r.get("interval_s")]
    if undeclared:
        lines.append(f"  not moved yet (others beat 1-2 times; may be a slow interval): {format_ranks(undeclared)}")
    if hb["absent"] and len(hb["absent"]) < world:
        lines.append(f"  no counter (closed, or never started): {format_ranks(hb['absent'])}")
    return lines


def render(report: dict[str, Any]) -> str:
    """The report as text, one block per group and per torchrun run."""
    head = f"torch_ctrl inspect {report['store']}: {report.get('num_keys', '?')} keys"
    head += f", {report.get('torch_ctrl_keys', 0)} of torch_ctrl"
    if report.get("samples", 1) > 1:
        head += f"; {report['samples']} samples over {_secs(report['observed_s'])}"
    lines = [head]
    lines += [f"! {text}" for text in report.get("limitations", [])]
    for run in report.get("torchrun", []):
        lines += [""] + _run_lines(run)
    groups = report.get("groups", [])
    if not groups:
        lines += ["", "no torch_ctrl group found"]
    for g in groups:
        lines += ["", _group_title(g)]
        if g["abort"]:
            lines.append(f"  ABORTED by rank {g['abort']['rank']}: {g['abort']['reason'] or 'no reason given'}")
        ops = g["in_flight"]
        lines.append(f"  in flight: {len(ops)}")
        for op in ops[:MAX_OPS]:
            lines.append(f"    {_op_line(op)}")
        if len(ops) > MAX_OPS:
            lines.append(f"    and {len(ops) - MAX_OPS} more (--json lists them all)")
        if g["finished_awaiting_cleanup"]:
            lines.append(f"  finished, keys awaiting cleanup: {g['finished_awaiting_cleanup']}")
        if g["heartbeats"]:
            lines += ["  " + x for x in _heartbeat_lines(g["heartbeats"], g["world_size"])]
        else:
            lines.append("  heartbeats: off")
    return "\n".join(lines)


def _run_lines(run: dict[str, Any]) -> list[str]:
    state = run.get("state") or {}
    rounds = ", ".join(str(r) for r in run["rounds_seen"]) or "none"
    head = f"torchrun run {run['run_id']!r} ({run['rendezvous']} rendezvous): round {run.get('round')}"
    lines = [f"{head} (rounds with keys: {rounds})"]
    if state.get("error"):
        lines.append(f"  {state['error']}")
    elif state:
        flags = ["complete" if state["complete"] else "gathering nodes"] + (["closed"] if state["closed"] else [])
        lines.append(f"  rendezvous: {', '.join(flags)}; {len(state['nodes'])} node(s)")
        for node in state["nodes"][:16]:
            lines.append(f"    node {node['rank']}: host {node['host']} (agent pid {node['pid']}){_keep_alive(node)}")
        if len(state["nodes"]) > 16:
            lines.append(f"    and {len(state['nodes']) - 16} more")
        if state["waiting"]:
            lines.append(f"  waiting to join the next round: {', '.join(n['host'] for n in state['waiting'][:16])}")
    if run.get("failure"):
        lines.append(f"  FAILURE NOTICE (node {run['failure']['rank']}): {run['failure']['reason']}")
    if run.get("workers_store"):
        err = run.get("workers_store_error")
        lines.append(f"  workers' store: {run['workers_store']}" + (f" ({err})" if err else ""))
    return lines


def _keep_alive(node: dict[str, Any]) -> str:
    if node.get("withdrawn"):
        return ", withdrew (left the rendezvous)"
    if "keep_alive_age_s" not in node:
        return ""
    text = f", keep-alive {_secs(node['keep_alive_age_s'])} ago"
    if node.get("keep_alive_stale"):
        limit = node.get("keep_alive_dead_after_s")
        if limit is not None:  # the node's own keep_alive_interval x keep_alive_max_attempt
            text += f": STALE (past the {_secs(limit)} after which the rendezvous takes it for dead)"
        else:
            dead_after = f"{KEEP_ALIVE_DEAD_AFTER:g}s"
            text += f": STALE (past the {dead_after} after which the rendezvous takes a node for dead, by default)"
    return text
