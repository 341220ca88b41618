"""``python -m torch_ctrl bench`` runs end to end (real stores, threads and a real torchrun job) and
reports every op over every store kind asked for. No timing assertions: figures are the docs' business."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import torch_ctrl
from torch_ctrl import bench, bench_report, capabilities, lanes

FULL_API = ("torch", "cpp", "python")  # the contenders that run every op, where this installation has them


def _bench(out: Path, *args: str, timeout: float = 110) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
    cmd = [sys.executable, "-m", "torch_ctrl", "bench", *args, "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads((out / "results.json").read_text())


def _check_every_op(data: dict[str, Any], stores: list[str], worlds: list[int], rounds: int) -> None:
    """Every op of every full-API contender has ``rounds`` samples over each store kind and world size."""
    assert data["meta"]["stores"] == stores
    present = [c for c in FULL_API if c not in bench.unavailable()]
    got = {(r["store"], r["world_size"], r["op"], r["contender"]): r for r in data["latency"]}
    for key in ((s, n, op, c) for s in stores for n in worlds for op in bench.OPS for c in present):
        assert key in got, key
        assert len(got[key]["samples_ms"]) == rounds and got[key]["median_ms"] > 0, got[key]
        assert not got[key]["errors"], got[key]
    assert {r["store"] for r in data["latency"]} == set(stores)


@pytest.mark.timeout(120)
def test_smoke_covers_raw_and_prefix(tmp_path: Path) -> None:
    done, data = _bench(tmp_path, "--smoke")
    _check_every_op(data, ["raw", "prefix"], [2], 3)
    assert all(r["mode"] == "threads" for r in data["latency"])
    assert data["op_counts"] and all(r["store"] == "hash" for r in data["op_counts"])
    assert set(data["liveness_barrier_on_off"]) <= {"raw", "prefix"}
    text = (tmp_path / "results.md").read_text()
    # A header first: what was run, on what (as results.json's meta), then the tables as printed.
    lines = text.splitlines()
    assert lines[0] == "# torch_ctrl benchmark" and lines[2] == f"- command: `{data['meta']['command']}`", text[:800]
    head = text[: text.index("\n\n**")]
    for part in ("--smoke", "mode threads", "store kinds raw, prefix", f"torch {torch.__version__}"):
        assert part in head, (part, head)
    assert f"torch_ctrl {torch_ctrl.__version__}" in head and f"{os.cpu_count()} CPUs" in head, head
    text = text[len(head) :].lstrip("\n")
    missing = bench.unavailable()  # torch's class (torch 2.14+), the C++ extension (pure-Python installs)
    if "torch" not in missing:
        cpp = "" if "cpp" in missing else " raw: C++ |"
        assert f"| op | N | raw: torch |{cpp} raw: Python | prefix: torch |" in text
    assert ("raw: C++" in text) == ("cpp" not in missing)
    assert "### Store: raw (" in text and "### Store: prefix (" in text
    assert text in done.stdout + "\n"  # what is printed is what is written
    if "no plot" not in done.stdout:  # matplotlib is installed
        for name in ("latency-raw.png", "latency-prefix.png", "latency.png"):
            assert (tmp_path / name).stat().st_size > 0, name
    # Results only: the project's performance targets live in docs/benchmarks.md, not in the output.
    assert "Targets" not in done.stdout and "MISSED" not in done.stdout and "target" not in done.stdout


@pytest.mark.timeout(120)
def test_smoke_over_file_and_hash_stores(tmp_path: Path) -> None:
    _, data = _bench(tmp_path, "--smoke", "--store", "file,hash", "--count-store", "file,hash")
    _check_every_op(data, ["file", "hash"], [2], 3)
    assert {r["store"] for r in data["op_counts"]} == {"file", "hash"}
    assert all(not r["errors"] for r in data["op_counts"])


@pytest.mark.timeout(120)
def test_torchrun_mode_reports_every_op(tmp_path: Path) -> None:
    args = ("--mode", "torchrun", "--world-sizes", "2", "--rounds", "2", "--count-world-sizes", "", "--timeout", "30")
    done, data = _bench(tmp_path, *args)
    _check_every_op(data, ["raw", "prefix"], [2], 2)
    assert data["meta"]["mode"] == "torchrun" and all(r["mode"] == "torchrun" for r in data["latency"])
    assert "from_env()" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--mode", "torchrun", "--world-sizes", "2,32"], "up to 16"),
        (["--mode", "processes", "--store", "hash"], "--store hash needs --mode threads"),
        (["--store", "raw,nfs"], "unknown name 'nfs'"),
        # Each of these was a torch C++ stack trace, a ValueError or MemoryError traceback, a run
        # that measured nothing and exited 0, or a run that never ends.
        (["--timeout", "0"], "--timeout must be a finite number of seconds > 0"),
        (["--timeout", "-5"], "--timeout must be a finite number of seconds > 0"),
        (["--timeout", "nan"], "--timeout must be a finite number of seconds > 0"),
        (["--timeout", "inf"], "--timeout must be a finite number of seconds > 0"),
        (["--timeout", "1e10"], "<= 604800 (a week)"),
        (["--payload", "999999999999"], "--payload must be at most 268435456 bytes (256 MiB)"),
        (["--payload", "-1"], "--payload >= 0"),
        (["--rounds", "1000000000"], "--rounds must be at most 100000"),
        (["--ops", ""], "--ops: no ops given"),
        (["--ops", " , "], "--ops: no ops given"),
        (["--contenders", ""], "--contenders: no contenders given"),
        (["--world-sizes", ""], "--world-sizes: no world sizes given"),
        (["--world-sizes", "2,10000000"], "--mode threads supports world sizes up to 4096"),
        (["--count-world-sizes", "5000"], "the counts run a thread per rank, up to 4096"),
    ],
)
def test_rejected_options(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_largest_accepted_values() -> None:
    opts = bench.parse_args(["--world-sizes", "4096", "--payload", str(256 << 20), "--timeout", "604800"])
    assert opts.worlds == [4096] and len(opts.data) == 256 << 20 and opts.timeout == 604800
    assert bench.parse_args(["--payload", "0", "--timeout", "0.5"]).data == b""


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cap", "0"], "--cap must be a finite number of seconds > 0"),
        (["--cap", "nan"], "--cap must be a finite number of seconds > 0"),
        (["--cap", "inf"], "--cap must be a finite number of seconds > 0"),
        (["--nodes", ""], "--nodes: no node counts given"),
        (["--nodes", "8,10000000"], "--nodes must be >= 1 and <= 4096"),
        (["--backends", ""], "--backends: no backends given"),
        (["--backends", "ctrl,etcd"], "--backends: unknown 'etcd'"),
    ],
)
def test_rendezvous_rejected_options(args: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from torch_ctrl import bench_rendezvous

    with pytest.raises(SystemExit) as exc:
        bench_rendezvous.parse_args(args)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("command", [[], ["rendezvous"]])
def test_an_out_directory_that_cannot_be_written_fails_before_the_run(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad --out is reported at once, in one line naming it (it was a traceback, for bench
    after the whole run), and nothing is run."""
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    for out, why in (("/proc/nope", "No such file or directory"), (str(a_file), "not a directory")):
        assert bench.main([*command, "--out", out]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"error: --out {out}: " in err and why in err, err


def test_cli_reports_bad_options_without_a_traceback() -> None:
    env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
    for args in (["--timeout", "nan"], ["rendezvous", "--cap", "inf"]):
        cmd = [sys.executable, "-m", "torch_ctrl", "bench", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert "must be a finite number of seconds > 0" in done.stderr.splitlines()[-1], done.stderr


def test_smoke_keeps_the_options_given_with_it() -> None:
    """--smoke sets the quick run's defaults; options given explicitly win (N=8 was run as N=2)."""
    smoke = bench.parse_args(["--smoke"])
    assert (smoke.worlds, smoke.rounds, smoke.ops, smoke.count_worlds) == ([2], 3, list(bench.OPS), [2])
    given = bench.parse_args(["--smoke", "--world-sizes", "8", "--rounds", "5", "--ops", "barrier"])
    assert (given.worlds, given.rounds, given.ops, given.count_worlds) == ([8], 5, ["barrier"], [2])
    assert bench.parse_args(["--smoke", "--count-world-sizes", ""]).count_worlds == []
    assert bench.parse_args(["--smoke", "--contenders", "floor"]).contenders == ["floor"]


def test_default_world_sizes_follow_the_mode() -> None:
    assert bench.parse_args([]).worlds == [2, 8, 32, 128, 512]
    assert bench.parse_args([]).rounds == 20 and bench.parse_args([]).count_worlds == [2, 8]
    assert bench.parse_args(["--mode", "torchrun"]).worlds == [2, 8, 16]
    assert bench.parse_args(["--count-store", "tcp,prefix"]).count_stores == ["raw", "prefix"]
    assert bench.parse_args([]).stores == ["raw", "prefix"]


def test_the_python_twin_runs_above_128_threads_only_when_named() -> None:
    """By default N PyStoreCollectives in one interpreter stop at N=128 (above, a run takes tens of
    minutes measuring the GIL); named in --contenders, or in another mode, it runs at every N."""
    default = bench.parse_args([])
    assert "python" in bench.contenders_at(128, default)
    assert "python" not in bench.contenders_at(512, default)
    assert set(bench.contenders_at(512, default)) == set(default.contenders) - {"python"}
    named = bench.parse_args(["--contenders", "torch,cpp,python"])
    assert "python" in bench.contenders_at(512, named)
    processes = bench.parse_args(["--mode", "processes"])
    assert "python" in bench.contenders_at(16, processes)
    default.file_dir = None  # set by main(); a raw store has no file
    world = bench.world_for(512, "raw", 0, default, "t")
    assert "python" not in world.contenders and all(c != "python" for _, _, c in world.tasks)


def test_blocks_order_runs_each_contender_back_to_back(tmp_path: Path) -> None:
    """``--order blocks`` times what an application using one implementation sees: its rounds back
    to back, its cleanup meeting its own next op, never another contender's."""
    blocks = bench.schedule(["barrier"], ["torch", "cpp"], 3, order="blocks")
    assert [c for _, _, c in blocks] == ["torch"] * 4 + ["cpp"] * 4
    assert [r for _, r, _ in blocks] == [-1, 0, 1, 2] * 2
    interleaved = bench.schedule(["barrier"], ["torch", "cpp"], 3)
    assert [c for _, _, c in interleaved[:4]] == ["cpp", "torch", "torch", "cpp"]  # rotates each round
    assert sorted(blocks) == sorted(interleaved)  # the same tasks, in another order
    args = ("--world-sizes", "2", "--rounds", "2", "--ops", "barrier,broadcast", "--order", "blocks")
    done, data = _bench(tmp_path, *args, "--count-world-sizes", "", "--store", "prefix")
    assert data["meta"]["order"] == "blocks" and "order=blocks" in done.stdout
    present = [c for c in FULL_API if c not in bench.unavailable()]
    got = {(r["op"], r["contender"]): r for r in data["latency"]}
    for op, c in ((op, c) for op in ("barrier", "broadcast") for c in present):
        assert len(got[op, c]["samples_ms"]) == 2 and not got[op, c]["errors"], got[op, c]


class _Probe:
    """A stand-in instance (the floor contender's one call, ``add``) that records whether the
    process's turn (``lanes.turn()``) was held when it was made and when it was freed."""

    def __init__(self, seen: list[tuple[str, bool]]) -> None:
        self.seen = seen
        seen.append(("made", lanes._CONNECT._is_owned()))

    def add(self, key: str, amount: int) -> int:
        return amount

    def __del__(self) -> None:
        self.seen.append(("freed", lanes._CONNECT._is_owned()))


@pytest.mark.timeout(60)
def test_rank_threads_make_and_free_their_instances_in_the_turn(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a torch without clone() (2.6, 2.7), a thread that makes or frees torch objects while another
    constructs a TCPStore client can abort the process; the benchmark's rank threads therefore make
    and free their stores and instances in the process's turn (seen aborting 1 run in 18 of
    ``bench --smoke`` on torch 2.6 before)."""
    monkeypatch.setattr(capabilities, "CLONE", False)  # turn() is the lock, as on torch 2.6
    seen: list[tuple[str, bool]] = []
    world = 3
    w = bench.World(world, 0, ["floor"], [("barrier", r, "floor") for r in (-1, 0, 1)], b"x", 30.0, "t", "hash")
    sync = threading.Barrier(world)
    results: dict[int, Any] = {}

    def rank(r: int) -> None:
        results[r] = bench.rank_main(w, r, sync, make=lambda c, store, rk, n: _Probe(seen))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == list(range(world)) and all(len(v) == 3 and not v[0][2] for v in results.values())
    assert sorted(seen) == [("freed", True)] * world + [("made", True)] * world, seen


def test_results_md_header_names_the_run() -> None:
    meta = dict(nproc=2, cpu="AMD EPYC", torch="2.13.0+cpu", torch_ctrl="0.2.0", backend="cpp", python="3.11.7")
    meta.update(command="python -m torch_ctrl bench --store file", open_files=1024, mode="processes", stores=["file"])
    meta.update(payload=64, rounds=20, timeout_s=120.0, order="blocks", count_stores=[], world_sizes=[2, 8])
    meta.update(absent={"torch._StoreCollectives": "absent: no class"}, started="2026-12-06 10:00:00 UTC", seconds=9.5)
    assert bench_report.header(meta).splitlines() == [
        "# torch_ctrl benchmark",
        "",
        "- command: `python -m torch_ctrl bench --store file`",
        "- run: mode processes; store kinds file; N = 2, 8; 20 rounds (half, >= 3, for N >= 256); order blocks; "
        "payload 64 B; timeout 120 s",
        "- store-call counts: none",
        "- versions: torch_ctrl 0.2.0 (backend cpp), torch 2.13.0+cpu, Python 3.11.7",
        "- machine: 2 CPUs (AMD EPYC), open files 1024",
        "- not measured: torch._StoreCollectives: absent: no class",
        "- started 2026-12-06 10:00:00 UTC, took 9.5 s",
    ]
    assert bench.machine()["torch_ctrl"] == torch_ctrl.__version__


def test_rendezvous_bench_prints_results_not_targets(tmp_path: Path) -> None:
    # Targets belong in the docs: the tool prints and writes its figures, and fails (exit 1)
    # only when a ctrl rendezvous did not complete.
    env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
    cmd = [sys.executable, "-m", "torch_ctrl", "bench", "rendezvous", "--nodes", "8", "--backends", "ctrl"]
    done = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=110, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    md = (tmp_path / "rendezvous.md").read_text()
    assert md.startswith("# torch_ctrl rendezvous benchmark\n\n- command: `python -m torch_ctrl bench rendezvous "), md
    assert "- run: backends ctrl; N = 8; cap 120 s" in md, md
    assert md.splitlines()[-1].startswith("| 8 | "), md
    for text in (md, done.stdout):
        assert "target" not in text.lower() and "MISSED" not in text, text
    from torch_ctrl.bench_rendezvous import failures

    ok = dict(backend="ctrl", n=512, seconds=0.3, returned=512, errors=[])
    assert failures([ok, dict(backend="c10d", n=512, seconds=None, returned=0, errors=[])]) == []
    late = dict(backend="ctrl", n=2048, seconds=None, returned=2000, errors=["RendezvousTimeoutError"])
    assert failures([ok, late]) == ["ctrl N=2048: 2000/2048 returned (RendezvousTimeoutError)"]
