"""The tables and plots of ``python -m torch_ctrl bench``: Markdown (printed and ``results.md``)
and PNG, one set per store kind, with the kinds side by side."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .bench import BASELINE, CONTENDERS, COUNTED, HEARTBEAT, LABELS, OPS, STORE_TEXT

Record = dict[str, Any]
SHORT = {"torch": "torch", "cpp": "C++", "python": "Python"}  # the side-by-side table's columns
STYLES = ("-", "--", ":", "-.")  # one line style per store kind in the combined plot
STYLE_NAMES = dict(zip(STYLES, ("solid", "dashed", "dotted", "dash-dot")))


def _md(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _num(x: Any) -> str:
    return f"{x:g}" if isinstance(x, (int, float)) else str(x)


def header(meta: dict[str, Any], title: str = "torch_ctrl benchmark") -> str:
    """Markdown: a title line, then what the run was, from ``meta`` (``results.json``'s): the command,
    the mode, store kinds and other settings, the versions and the machine."""
    get = meta.get
    cmd = get("command", "")
    tick = "``" if "`" in cmd else "`"
    lines = [f"# {title}", "", f"- command: {tick}{cmd}{tick}"]
    if "mode" in meta:  # python -m torch_ctrl bench
        run = [f"mode {meta['mode']}", "store kinds " + ", ".join(get("stores", []))]
        run += ["N = " + ", ".join(map(str, get("world_sizes", [])))] if get("world_sizes") else []
        run += [f"{get('rounds')} rounds (half, >= 3, for N >= 256)", f"order {get('order')}"]
        run += [f"payload {get('payload')} B", f"timeout {_num(get('timeout_s'))} s"]
        lines.append("- run: " + "; ".join(run))
        counts = ", ".join(get("count_stores") or []) or "none"
        if get("count_stores") and get("count_world_sizes"):
            counts += " at N = " + ", ".join(map(str, get("count_world_sizes")))
        lines.append(f"- store-call counts: {counts}")
    if "backends" in meta:  # python -m torch_ctrl bench rendezvous
        nodes = ", ".join(map(str, get("nodes", [])))
        lines.append(f"- run: backends {', '.join(meta['backends'])}; N = {nodes}; cap {_num(get('cap_s'))} s")
    impl = f" (backend {get('backend')})" if get("backend") else ""
    lines.append(f"- versions: torch_ctrl {get('torch_ctrl', '?')}{impl}, torch {get('torch')}, Python {get('python')}")
    lines.append(f"- machine: {get('nproc')} CPUs ({get('cpu')}), open files {get('open_files')}")
    if get("absent"):
        lines.append("- not measured: " + "; ".join(f"{name}: {why}" for name, why in meta["absent"].items()))
    when = [f"started {get('started')}"] if get("started") else []
    when += [f"took {get('seconds')} s"] if get("seconds") is not None else []
    if when:
        lines.append("- " + ", ".join(when))
    return "\n".join(lines)


def _cells(records: list[Record]) -> tuple[list[tuple[str, int]], dict[tuple[str, int, str], Record]]:
    keys = sorted({(r["op"], r["world_size"]) for r in records}, key=lambda k: (OPS.index(k[0]), k[1]))
    return keys, {(r["op"], r["world_size"], r["contender"]): r for r in records}


def stores_of(records: list[Record]) -> list[str]:
    """The store kinds in ``records``, in the order they first appear."""
    return list(dict.fromkeys(r["store"] for r in records))


def _median(r: Record | None) -> str:
    if r is None:
        return ""
    if r["median_ms"] is None:
        return f"failed ({len(r['errors'])})"
    text = f"{r['median_ms']:.2f}"
    if r["ratio"] is not None and r["contender"] != BASELINE:
        text += f" ({r['ratio']:.2f}x)"
    return text + (f" ({len(r['errors'])} failed)" if r["errors"] else "")


def latency_tables(records: list[Record], contenders: Sequence[str]) -> str:
    """Markdown for one store kind: the medians with their ratio to torch's class, then the min-max spread."""
    keys, cell = _cells(records)

    def spread(r: Record | None) -> str:
        if r is None:
            return ""
        if r["median_ms"] is None:
            return f"failed ({len(r['errors'])})"
        return f"{r['min_ms']:.2f}-{r['max_ms']:.2f}" + (f" ({len(r['errors'])} failed)" if r["errors"] else "")

    present = [c for c in contenders if any(r["contender"] == c for r in records)]
    head = ["op", "N"] + [LABELS[c] for c in present]
    out = []
    for fmt, title in ((_median, "median, ms (ratio to torch._StoreCollectives)"), (spread, "min-max, ms")):
        rows = [[op, str(n)] + [fmt(cell.get((op, n, c))) for c in present] for op, n in keys]
        out.append(f"**Latency over rounds: {title}**\n\n" + _md(head, rows))
    return "\n\n".join(out)


def side_by_side(records: list[Record]) -> str:
    """Markdown: torch's class, torch_ctrl C++ and Python over each store kind, one column group per kind
    (median ms, and the ratio to torch's class over the same kind)."""
    kinds = stores_of(records)
    cells = {(r["store"], r["op"], r["world_size"], r["contender"]): r for r in records}
    present = [c for c in SHORT if any(r["contender"] == c for r in records)]
    keys = sorted({(r["op"], r["world_size"]) for r in records}, key=lambda k: (OPS.index(k[0]), k[1]))
    head = ["op", "N"] + [f"{kind}: {SHORT[c]}" for kind in kinds for c in present]
    rows = [[op, str(n)] + [_median(cells.get((k, op, n, c))) for k in kinds for c in present] for op, n in keys]
    title = ", ".join(f"{k} = {STORE_TEXT[k]}" for k in kinds)
    return f"**Median, ms (ratio to torch._StoreCollectives over the same store), by store: {title}**\n\n" + _md(
        head, rows
    )


def liveness_ratios(records: list[Record]) -> dict[int, float]:
    """Barrier median of ``cpp-hb`` (liveness on) over ``cpp`` (off), per N where both ran (one store kind)."""
    _, cell = _cells(records)
    out = {}
    for (op, n, c), r in sorted(cell.items(), key=lambda kv: kv[0][1]):
        off = cell.get((op, n, "cpp"), {}).get("median_ms")
        if op == "barrier" and c == "cpp-hb" and off and r["median_ms"] is not None:
            out[n] = r["median_ms"] / off
    return out


def liveness_line(ratios: dict[int, float]) -> str:
    """One line: the barrier's latency with liveness on over off, per N."""
    cells = ", ".join(f"N={n} {x:.2f}x" for n, x in ratios.items())
    return f"liveness on/off (barrier, heartbeat_interval={HEARTBEAT:g} s): {cells}"


def latency_report(records: list[Record], contenders: Sequence[str]) -> tuple[str, dict[str, dict[int, float]]]:
    """Markdown for every store kind in ``records`` (side by side first when there are several), and
    the liveness ratios per kind."""
    kinds = stores_of(records)
    parts = [side_by_side(records)] if len(kinds) > 1 else []
    liveness = {}
    for kind in kinds:
        mine = [r for r in records if r["store"] == kind]
        text = f"### Store: {kind} ({STORE_TEXT[kind]})\n\n" + latency_tables(mine, contenders)
        liveness[kind] = liveness_ratios(mine)
        if liveness[kind]:
            text += "\n\n" + liveness_line(liveness[kind])
        parts.append(text)
    return "\n\n".join(parts), {k: v for k, v in liveness.items() if v}


def count_tables(records: list[Record]) -> str:
    """Markdown per store kind: store operations per op per rank, and the critical path by method at the largest N."""
    out = []
    for kind in stores_of(records):
        mine = [r for r in records if r["store"] == kind]
        out.append(_count_tables(mine) + f"\n\n(CountingStore over {STORE_TEXT[kind]}: `{kind}`)")
    return "\n\n".join(out)


def _count_tables(records: list[Record]) -> str:
    keys, cell = _cells(records)

    def fmt(r: Record) -> str:
        other = "-" if r["critical_other_mean"] is None else f"{r['critical_other_mean']:.3g}"
        return f"{r['critical_root']} / {other}" + ("" if r["contender"] == BASELINE else f" ({r['total_mean']:.3g})")

    counted = [c for c in COUNTED if any(r["contender"] == c for r in records)]
    rows = [[op, str(n)] + [fmt(cell[(op, n, c)]) for c in counted] for op, n in keys]
    top = max(n for _, n in keys)
    detail = []
    for op, c in ((op, c) for op, n in keys if n == top for c in counted):
        ranks = cell[(op, top, c)]["per_rank"][:2]
        detail.append(
            [op, LABELS[c]] + [", ".join(f"{m} {k}" for m, k in p.get("critical", {}).items()) for p in ranks]
        )
    return (
        "**Store calls per rank: critical path, rank 0 (root) / other ranks (mean); (total incl. cleanup, mean)**\n\n"
        + _md(["op", "N"] + [LABELS[c] for c in counted], rows)
        + f"\n\n**Critical-path store calls by method, N={top}**\n\n"
        + _md(["op", "implementation", "rank 0 (root)", "rank 1"], detail)
    )


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _axes(plt: Any, ops: Sequence[str], title: str) -> tuple[Any, list[Any]]:
    cols, rows = min(3, len(ops)), (len(ops) + 2) // 3
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 4 * rows), squeeze=False)
    fig.suptitle(title)
    for ax in list(axes.flat)[len(ops) :]:
        ax.set_visible(False)
    return fig, list(axes.flat)[: len(ops)]


def _finish(plt: Any, fig: Any, axes: list[Any], ops: Sequence[str], path: Path) -> None:
    for ax, op in zip(axes, ops):
        ax.set(xscale="log", yscale="log", title=op, xlabel="world size (ranks)", ylabel="median latency (ms)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(records: list[Record], ops: Sequence[str], contenders: Sequence[str], path: Path, title: str = "") -> str:
    """Latency vs world size, log-log, a subplot per op, a line per contender (one store kind); returns a note."""
    try:
        plt = _pyplot()
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'torch-ctrl[plot]')"
    fig, axes = _axes(plt, ops, title)
    for ax, op in zip(axes, ops):
        for c in contenders:
            rs = [r for r in records if (r["op"], r["contender"]) == (op, c) and r["median_ms"]]
            if rs:
                xs, med = [r["world_size"] for r in rs], [r["median_ms"] for r in rs]
                err = [[m - r["min_ms"] for m, r in zip(med, rs)], [r["max_ms"] - m for m, r in zip(med, rs)]]
                ax.errorbar(xs, med, yerr=err, marker="o", capsize=2, label=LABELS[c], color=f"C{CONTENDERS.index(c)}")
    _finish(plt, fig, axes, ops, path)
    return f"plot: {path}"


def plot_stores(records: list[Record], ops: Sequence[str], path: Path, title: str = "") -> str:
    """torch's class, torch_ctrl C++ and Python over every store kind on one figure: colour per
    contender, line style per store kind (no min-max bars, to stay readable); returns a note."""
    try:
        plt = _pyplot()
    except ImportError:
        return "no plot: matplotlib is not installed (pip install 'torch-ctrl[plot]')"
    fig, axes = _axes(plt, ops, title)
    for ax, op in zip(axes, ops):
        for i, kind in enumerate(stores_of(records)):
            for c in SHORT:
                rs = [r for r in records if (r["store"], r["op"], r["contender"]) == (kind, op, c) and r["median_ms"]]
                if rs:
                    xs, med = [r["world_size"] for r in rs], [r["median_ms"] for r in rs]
                    style = dict(color=f"C{CONTENDERS.index(c)}", linestyle=STYLES[i % len(STYLES)], marker="o")
                    ax.plot(xs, med, label=f"{LABELS[c]} ({kind})", **style)
    _finish(plt, fig, axes, ops, path)
    return f"plot: {path}"


def plots(records: list[Record], ops: Sequence[str], contenders: Sequence[str], out: Path, title: str) -> list[str]:
    """``latency-<store>.png`` per store kind, and ``latency.png``: the only kind's figure, or all kinds
    on one (:func:`plot_stores`); returns the notes to print."""
    kinds = stores_of(records)
    notes = []
    for kind in kinds:
        mine = [r for r in records if r["store"] == kind]
        notes.append(plot(mine, ops, contenders, out / f"latency-{kind}.png", f"{title}, {kind} store"))
    if len(kinds) == 1:
        notes.append(plot(records, ops, contenders, out / "latency.png", f"{title}, {kinds[0]} store"))
    elif kinds:
        styles = ", ".join(f"{k} {STYLE_NAMES[STYLES[i % len(STYLES)]]}" for i, k in enumerate(kinds))
        notes.append(plot_stores(records, ops, out / "latency.png", f"{title}: {styles}"))
    return list(dict.fromkeys(notes))
