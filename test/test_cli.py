"""The shipped commands run: the demo, inspect, and every command's --help and --version
(the benchmark's runs are in test_bench.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

import torch_ctrl
from torch_ctrl import capabilities


@pytest.mark.timeout(180)
def test_demo_runs_and_checks_results(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "torch_ctrl", "demo", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=170,
        env=env,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "torch_ctrl.run --standalone" in out.stdout  # a real torchrun job, ctrl backend
    assert "all results correct" in out.stdout
    assert "keys the demo left in the store: 0" in out.stdout
    assert "torchrun exited 0" in out.stdout
    for op in ("barrier", "broadcast_recv", "gather_recv", "scatter_recv", "all_gather", "all_sum"):
        assert op in out.stdout
    assert list(tmp_path.iterdir()) == []  # nothing left behind (torchrun's log directory neither)


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_cli_usage() -> None:
    out = _run("-m", "torch_ctrl", "nope")
    assert out.returncode == 2 and "usage" in out.stderr and "invalid choice" in out.stderr
    out = _run("-m", "torch_ctrl")
    assert out.returncode == 2 and "inspect" in out.stderr
    for address in ("127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", "127.0.0.1:x"):  # bad arguments: 2, not 1
        out = _run("-m", "torch_ctrl", "inspect", address)
        assert out.returncode == 2 and "expected HOST:PORT" in out.stderr, (address, out.stderr)
    for option in (("--timeout", "nan"), ("--timeout", "inf"), ("--timeout", "0"), ("--interval", "nan")):
        out = _run("-m", "torch_ctrl", "inspect", "127.0.0.1:1", *option)
        assert out.returncode == 2 and "--interval must be 0 to" in out.stderr, (option, out.stderr)


def test_help_and_version() -> None:
    top = _run("-m", "torch_ctrl", "--help")
    assert top.returncode == 0
    for command in ("inspect", "info", "demo", "bench"):
        line = next(ln for ln in top.stdout.splitlines() if ln.strip().startswith(command + " "))
        assert len(line.split(None, 1)[1]) > 20, line  # a one-line description
    for command in ("inspect", "info", "demo", "bench", "bench rendezvous"):
        out = _run("-m", "torch_ctrl", *command.split(), "--help")
        assert out.returncode == 0 and out.stdout.startswith(f"usage: torch-ctrl {command} "), out.stdout[:200]
    assert "--watch" in _run("-m", "torch_ctrl", "inspect", "--help").stdout
    version = _run("-m", "torch_ctrl", "--version")
    assert version.returncode == 0 and version.stdout.strip() == f"torch_ctrl {torch_ctrl.__version__}"
    run = _run("-m", "torch_ctrl.run", "--help")
    assert run.returncode == 0 and "python -m torch_ctrl.run" in run.stdout
    text = " ".join(run.stdout.split())
    assert "torchrun with torch_ctrl" in text and "'ctrl' rendezvous backend as the default" in text
    assert "--standalone starts a single-node job with a 'ctrl' rendezvous on localhost" in text


def test_info_prints_the_protocol_and_the_path_ranks_must_agree_on() -> None:
    """Ranks of one group must speak one protocol and take one path over a TCPStore: `info`
    prints both, from what this torch has."""
    from torch_ctrl import keys as K

    out = _run("-m", "torch_ctrl", "info")
    assert out.returncode == 0, out.stderr
    yes = {True: "yes", False: "no"}
    raw, prefix = yes[capabilities.BARRIER], yes[capabilities.BARRIER and capabilities.LIST_KEYS]
    expected = f"protocol: {K.PROTOCOL}; TCPStore path for barrier, all_gather, all_sum: raw {raw}, "
    expected += f"under PrefixStores {prefix}"
    assert expected in out.stdout, out.stdout
    assert f"backend: {torch_ctrl.backend()}" in out.stdout, out.stdout


def _quiet_on_broken_pipe(proc: subprocess.Popen[str]) -> None:
    """The command, its stdout closed by the reader, exits 1 with nothing on stderr (the Python
    docs' recipe, "Note on SIGPIPE"): no BrokenPipeError traceback, no "Exception ignored"."""
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "BrokenPipe" not in err and "Broken pipe" not in err, err
    assert not [ln for ln in err.splitlines() if not ln.startswith("[W")], err  # torch's own C++ warnings aside


@pytest.mark.parametrize(
    "args", [["torch_ctrl", "info"], ["torch_ctrl", "--help"], ["torch_ctrl", "bench", "--help"], ["torch_ctrl.info"]]
)
def test_output_into_a_closed_pipe_ends_quietly(args: list[str]) -> None:
    """`torch-ctrl info | head -1` where the reader has gone before the command writes (here: it
    closes its end at once): the command's write, or its last flush, meets a broken pipe. stdout
    buffered, as by default (unbuffered, argparse's --help swallows the error itself)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["RES_OPTIONS"] = "timeout:1 attempts:1"
    cmd = [sys.executable, "-W", "ignore", "-m", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    proc.stdout.close()  # the command is still starting up (importing torch): nothing written yet
    _quiet_on_broken_pipe(proc)


@pytest.mark.skipif(not capabilities.LIST_KEYS, reason="this torch's TCPStore cannot list its keys")
def test_a_reader_that_stops_after_one_line_ends_inspect_watch_quietly() -> None:
    """`torch-ctrl inspect --watch --json | head -1`: the reader reads one line and goes; the next
    refresh meets the broken pipe (it was reported as "cannot read HOST:PORT: Broken pipe")."""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    cmd = [sys.executable, "-W", "ignore", "-m", "torch_ctrl", "inspect", f"127.0.0.1:{server.port}", "--watch"]
    cmd += ["--json", "--interval", "0.1", "--timeout", "30"]
    env = {**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    assert json.loads(proc.stdout.readline())["schema"] == "torch_ctrl.inspect/1"
    proc.stdout.close()
    _quiet_on_broken_pipe(proc)


@pytest.mark.skipif(not capabilities.LIST_KEYS, reason="this torch's TCPStore cannot list its keys")
def test_inspect_command_json_text_prefix_and_watch() -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    coll = torch_ctrl.StoreCollectives(dist.PrefixStore("jobA", server), 0, 2)
    coll.barrier("half", block=False)  # 1/2 arrived, nobody blocked: the op stays in flight
    coll.abort("stopping")
    address = f"127.0.0.1:{server.port}"
    text = _run("-m", "torch_ctrl", "inspect", address, "--timeout", "30", "--interval", "0")
    assert text.returncode == 0, text.stderr
    assert "group of 2 ranks (prefix 'jobA/')" in text.stdout and "ABORTED by rank 0: stopping" in text.stdout
    assert "barrier 'half'; 1/2 arrived" in text.stdout
    doc = json.loads(
        _run("-m", "torch_ctrl", "inspect", address, "--timeout", "30", "--json", "--interval", "0.1").stdout
    )
    assert doc["schema"] == "torch_ctrl.inspect/1" and doc["samples"] == 2
    (group,) = doc["groups"]
    assert group["abort"] == {"rank": 0, "reason": "stopping"} and group["in_flight"][0]["key"] == "half"
    other = json.loads(
        _run(
            "-m", "torch_ctrl", "inspect", address, "--timeout", "30", "--json", "--interval", "0", "--prefix", "jobB"
        ).stdout
    )
    assert other["groups"] == []
    # An address nothing listens on, or a name that does not resolve: one line at once, even
    # with a long timeout (torch's connect loop would retry for all of it, printing C++ traces).
    for nowhere in ("127.0.0.1:1", "no-such-host.invalid:29500"):
        # -W ignore: a Python warning torch itself prints on import (e.g. without NumPy) is not
        # the command's; C++ log lines and traces are no Python warnings, and still count.
        bad = _run("-W", "ignore", "-m", "torch_ctrl", "inspect", nowhere, "--timeout", "60", "--interval", "0")
        assert bad.returncode == 1, bad.stderr
        assert bad.stderr.strip() == bad.stderr.strip().splitlines()[0], bad.stderr  # one line, nothing else
        said = f"torch-ctrl inspect: cannot read {nowhere}: the store's server {nowhere} is unreachable"
        assert bad.stderr.startswith(said), bad.stderr

    # A suite started in the background of a non-interactive shell (`cmd &`) inherits SIGINT
    # ignored, and so would the child, which Ctrl-C then could not stop: a handler here makes
    # the child start with SIGINT at its default (exec resets handled signals, not ignored ones).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        watch = subprocess.Popen(
            [sys.executable, "-m", "torch_ctrl", "inspect", address, "--watch", "--interval", "0.2", "--timeout", "30"],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "RES_OPTIONS": "timeout:1 attempts:1"},
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert watch.stdout is not None
    seen = 0
    for line in watch.stdout:  # refreshes until interrupted
        seen += line.startswith("torch_ctrl inspect ")
        if seen == 3:
            break
    watch.send_signal(signal.SIGINT)
    # Keep reading: a refresh written meanwhile must not leave the exiting process blocked on a
    # full pipe (its last flush happens at exit).
    watch.communicate(timeout=60)
    assert watch.returncode == 0
    coll.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("level", ["INFO", None])
def test_torch_ctrl_run_prints_its_info_lines_under_loglevel(tmp_path: Path, level: str | None) -> None:
    """Under torchrun's LOGLEVEL=INFO, `python -m torch_ctrl.run` prints torch_ctrl's INFO lines
    next to torch's: which process hosts the rendezvous store and on which port (what to
    `inspect` under --standalone), and the rounds. Without it, nothing more than before."""
    script = tmp_path / "w.py"
    script.write_text("print('worker ran')\n")
    env = {k: v for k, v in os.environ.items() if k != "LOGLEVEL"}
    env.update({"RES_OPTIONS": "timeout:1 attempts:1", **({"LOGLEVEL": level} if level else {})})
    out = subprocess.run(
        [sys.executable, "-m", "torch_ctrl.run", "--standalone", "--nproc-per-node=1", str(script)],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
    )
    assert out.returncode == 0 and "worker ran" in out.stdout, out.stderr[-3000:]
    said = "hosts the ctrl rendezvous store on port" in out.stderr and "joined round 0" in out.stderr
    assert said == (level is not None), out.stderr[-3000:]
