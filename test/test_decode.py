"""Decoding what comes out of the store: bounded, strict, and the same in both twins.

The twins' decoders (``torch_ctrl/keys.py`` and ``csrc/keys.cpp``) are fuzzed against each
other: for any bytes, the same value or the same error message. Then hostile values written
into a live group's keys must end the op with one CollectiveError line naming the key, fast
and without a large allocation, in both implementations.
"""

from __future__ import annotations

import math
import threading
import time

import pytest
from helpers import IMPLS, Stores, make, run_ranks
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import torch_ctrl
from torch_ctrl import capabilities
from torch_ctrl import keys as K
from torch_ctrl.errors import CollectiveError

HAVE_CPP = torch_ctrl.backend() == "cpp"
KINDS = ["chunks", "counter", "total", "frames", "names", "reader", "beat", "world_sizes"]


def _outcome(fn, *args):  # noqa: ANN001, ANN202
    try:
        value = fn(*args)
    except ValueError as exc:
        return ("error", str(exc))
    if isinstance(value, list):
        value = [tuple(v) if isinstance(v, tuple) else v for v in value]
    return ("value", value)


def _both(kind: str, data: bytes, world: int) -> None:
    from torch_ctrl import _C

    py = _outcome(K.decode, kind, data, world)
    cpp = _outcome(_C._decode, kind, data, world)
    assert py == cpp, (kind, data, world)


# Near-valid inputs: the pieces the encoders use, glued in any order.
_PIECES = st.sampled_from(
    [b"-1", b"0", b"1", b"7", b"-", b"+", b" ", b"_", b":", b",", b"C", b"D", b"A", b"00", b"3:", b"99999999999"]
    + [b"9223372036854775807", b"9223372036854775808", b"-9223372036854775808", b"18446744073709551616"]
    + [b"4194304", b"4194305", b"4195304", b"8388608"]  # heartbeat counters: K.BEAT and an interval
)
_NEAR = st.lists(st.one_of(_PIECES, st.binary(max_size=3)), max_size=12).map(b"".join)


@pytest.mark.skipif(not HAVE_CPP, reason="needs the C++ extension")
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(KINDS), st.one_of(st.binary(max_size=40), _NEAR), st.integers(0, 8))
def test_twins_decode_any_bytes_alike(kind: str, data: bytes, world: int) -> None:
    _both(kind, data, world)


@pytest.mark.skipif(not HAVE_CPP, reason="needs the C++ extension")
@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.integers(-3, 9), st.binary(max_size=6)), max_size=6),
    st.integers(1, 8),
    st.sampled_from([b"", b"x", b"1:", b"-1:9:"]),
)
def test_twins_decode_logs_alike(frames: list[tuple[int, bytes]], world: int, tail: bytes) -> None:
    """Logs made of real frames (out-of-range, duplicate and abort ranks included), possibly
    with a torn last entry."""
    log = b"".join(K.frame(r, p) for r, p in frames) + tail
    _both("frames", log, world)


@pytest.mark.skipif(not HAVE_CPP, reason="needs the C++ extension")
@given(st.lists(st.integers(0, 3 * K.CHUNK), max_size=4))
@settings(max_examples=60, deadline=None)
def test_twins_check_chunk_sizes_alike(sizes: list[int]) -> None:
    _both("chunk_sizes", " ".join(map(str, sizes)).encode(), 0)


# Key names as a store lists them: torch_ctrl's own (of several world sizes, tokens and fields),
# torn or altered ones, and anything else a store may hold.
_NAME_PIECES = st.sampled_from(
    [K.PROTOCOL.encode() + b"/w", b"3", b"2", b"0", b"-1", b"007", b"2147483648", b"99999999999999999999"]
    + [b"/", b"kx", b"kx/", b"kxy/", b"s0/", b"b", b"r1", b"w", b"torch_ctrl/2/w", b"job/", b"\xff"]
)
_NAME = st.lists(st.one_of(_NAME_PIECES, st.binary(max_size=2)), max_size=8).map(b"".join)


@pytest.mark.skipif(not HAVE_CPP, reason="needs the C++ extension")
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from([b"kx", b"s0"]), st.lists(_NAME.filter(lambda n: b"\n" not in n), max_size=6), st.integers(1, 8))
def test_twins_find_other_world_sizes_alike(token: bytes, names: list[bytes], world: int) -> None:
    _both("world_sizes", b"\n".join([token, *names]), world)


def test_other_world_sizes_reads_only_this_ops_keys() -> None:
    names = [
        f"{K.PROTOCOL}/w3/kx/b",  # the same op, world_size 3
        f"{K.PROTOCOL}/w4/kx/r1",  # and 4
        f"{K.PROTOCOL}/w2/kx/b",  # this group's own
        f"{K.PROTOCOL}/w5/kxy/b",  # another op
        f"{K.PROTOCOL}/w6/kx",  # no field: not a key torch_ctrl writes
        f"job/{K.PROTOCOL}/w7/kx/b",  # another namespace (a raw store lists every PrefixStore's keys)
        "torch_ctrl/2/w8/kx/b",  # another protocol version
        f"{K.PROTOCOL}/w0/kx/b",
        f"{K.PROTOCOL}/w-3/kx/b",
        f"{K.PROTOCOL}/w2147483648/kx/b",
    ]
    assert K.other_world_sizes(names, 2, "kx") == [3, 4]
    if HAVE_CPP:
        _both("world_sizes", "\n".join(["kx", *names]).encode(), 2)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(b"C2", 2), (b"C4096", 4096), (b"C99999999999", None), (b"C-1", None), (b"C1", None), (b"C 3", None)],
)
def test_chunk_counts_are_bounded(value: bytes, expected: int | None) -> None:
    if expected is None:
        with pytest.raises(K.DecodeError, match="bad chunk count"):
            K.chunk_count(value)
    else:
        assert K.chunk_count(value) == expected


@pytest.mark.parametrize("value", [b" 7", b"+7", b"1_0", b"9223372036854775808", b"", b"7 ", b"\xd9\xa3"])
def test_totals_and_counters_are_strict(value: bytes) -> None:
    """What Python's int() would take but C++'s from_chars would not is refused by both."""
    with pytest.raises(K.DecodeError):
        K.parse_counter(value)
    with pytest.raises(K.DecodeError):
        K.decode("total", value, 2)


@pytest.mark.parametrize("interval", [0.01, 0.0105, 0.1, 1.0, 5.0, 3600.0])
def test_a_heartbeat_counter_carries_its_ranks_interval(interval: float) -> None:
    """Whatever the beats since, a counter reads back the interval its rank declared (in ms,
    rounded up), and a counter without one (lost, or of an earlier version) declares none."""
    first = K.first_beat(interval)
    for beats in (0, 1, 1000):
        assert K.beat_interval(b"%d" % (first + beats * K.BEAT)) == math.ceil(interval * 1000) / 1000
    for value in (b"0", b"%d" % K.BEAT, b"%d" % (7 * K.BEAT), b"-5", b"x"):
        assert K.beat_interval(value) is None


def test_frames_out_of_range_or_twice_are_refused() -> None:
    with pytest.raises(K.DecodeError, match="frame of rank 5 in a group of 2"):
        K.parse_frames(K.frame(0, b"Dx") + K.frame(5, b"Dy"), 2)
    with pytest.raises(K.DecodeError, match="two frames of rank 0: another group uses the same store"):
        K.parse_frames(K.frame(0, b"Dx") + K.frame(0, b"Dy"), 2)
    assert K.parse_frames(K.frame(-1, b"0:stop") + K.frame(1, b"Dy"), 2) == [(-1, b"0:stop"), (1, b"Dy")]


# --------------------------------------------------------------- hostile values in a live group


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "prefix", "hash"])
@pytest.mark.parametrize("op", ["broadcast_recv", "scatter_recv"])
@pytest.mark.parametrize("value", [b"C99999999999", b"C-1", b"Zjunk"])
def test_hostile_slot_value_is_one_line_error(impl: str, kind: str, op: str, value: bytes) -> None:
    """A 12-byte value that would make a reader allocate without bound is refused at once."""
    stores = Stores(kind)
    coll = make(impl, stores.client(1), 1, 2)
    field = "d" if op == "broadcast_recv" else "r1"
    raw = stores.client(0)
    raw.set(f"{K.op_prefix(2, 'hostile', -1)}/{field}", value)
    with pytest.raises(CollectiveError) as info:
        getattr(coll, op)("hostile", timeout=20)
    coll.close()
    text = str(info.value)
    assert "\n" not in text and f"{K.op_prefix(2, 'hostile', -1)}/{field}: " in text, text  # names the key
    assert ("bad chunk count" in text) or (K.BAD_VALUE in text), text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("value", [b"zz", b"", b"1.5"])
def test_hostile_sum_is_one_line_error_naming_the_key(impl: str, value: bytes) -> None:
    """A total another program wrote where the generic all_sum publishes it (its done flag)."""
    stores = Stores("hash")
    stores.client(0).set(f"{K.op_prefix(2, 'hostile', -1)}/d", value)
    coll = make(impl, stores.client(1), 1, 2)
    with pytest.raises(CollectiveError) as info:
        coll.all_sum("hostile", 5, timeout=20)
    coll.close()
    text = str(info.value)
    assert "\n" not in text and f"{K.op_prefix(2, 'hostile', -1)}/d: {K.BAD_VALUE}" in text, text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "tcp_nolibuv", "prefix", "hash", "file"])
@pytest.mark.parametrize("op", ["barrier", "all_gather", "all_sum"])
def test_a_counter_that_is_not_a_number_is_named(impl: str, kind: str, op: str) -> None:
    """Garbage in an op's arrival counter: the store cannot add to it (TCPStore's server drops
    the connection, the other stores raise "stoll"). Every rank says which key holds what
    torch_ctrl could not have written, not "store unreachable" or a bare store error; the
    server stays up, and the next op works."""
    from torch_ctrl import capabilities

    stores = Stores(kind)
    prefix = K.op_prefix(2, "junk", -1)
    native = kind.startswith("tcp") or kind == "prefix"
    counter = K.counter(native and capabilities.tcpstore_path(kind == "prefix"))
    stores.client(9).set(f"{prefix}/{counter}", b"abc")
    colls = [make(impl, stores.client(r), r, 2) for r in range(2)]

    def body(rank: int) -> str:
        coll = colls[rank]
        try:
            if op == "barrier":
                coll.barrier("junk", timeout=20)
            elif op == "all_gather":
                coll.all_gather("junk", b"x", 20)
            else:
                coll.all_sum("junk", 1, 20)
            return "returned"
        except CollectiveError as exc:
            return str(exc)

    texts = run_ranks(2, body)
    if op == "all_gather" and counter == K.ARRIVE:
        assert texts == ["returned"] * 2  # the generic all_gather counts nothing: slots only
    elif kind == "prefix" and impl == "python" and not capabilities.CLONE and not capabilities.LIST_KEYS:
        # torch 2.6-2.7: the Python twin shares the PrefixStore's one client (it cannot open
        # another under the chain, docs/protocol.md), and the server has just dropped it
        assert all(t.startswith(f"{op} 'junk': store unreachable: ") for t in texts), texts
        return
    else:
        assert texts == [f"{op} 'junk': {prefix}/{counter}: {K.BAD_VALUE}"] * 2, texts
    assert run_ranks(2, lambda r: colls[r].barrier("next", timeout=20)) == [None, None]
    for c in colls:
        c.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_forged_duplicate_frame_is_a_collision_error(impl: str) -> None:
    """A second frame of rank 0 in an all_gather's log (another group on the same keys, or a
    forger) is an error naming the collision in both twins, never silently returned."""
    stores = Stores("tcp")
    log_key = f"{K.op_prefix(2, 'dup', -1)}/g"
    stores.client(9).append(log_key, K.frame(0, b"Dforged"))

    def body(rank: int) -> str:
        coll = make(impl, stores.client(rank), rank, 2)
        try:
            coll.all_gather("dup", b"mine", timeout=20)
            return "returned"
        except CollectiveError as exc:
            return str(exc)
        finally:
            coll.close()

    texts = run_ranks(2, body)
    from torch_ctrl import capabilities

    if not capabilities.BARRIER:
        pytest.skip("the generic path keeps one slot per rank: no log to forge")
    for text in texts:
        assert "two frames of rank 0" in text and "another group uses the same store" in text, texts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_more_arrivals_than_the_world_is_a_collision_error(impl: str) -> None:
    """Another group of the same world size with the same keys on a generic store (here its
    one arrival, already counted): the extra arrival is told that another group uses the same
    keys, instead of mixing the two groups' data."""
    stores = Stores("hash")
    stores.admin.add(f"{K.op_prefix(2, 'same', -1)}/n", 1)  # the other group's rank arrived first
    errors: list[str] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        coll = make(impl, stores.client(rank), rank, 2)
        try:
            coll.all_sum("same", 1, timeout=5)
        except CollectiveError as exc:
            with lock:
                errors.append(str(exc))
        finally:
            coll.close()

    run_ranks(2, body)
    assert any("3 arrivals in a group of 2" in e and "another group uses the same store" in e for e in errors), errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
def test_barrier_after_another_groups_release_is_a_collision_error(impl: str) -> None:
    """Another group of the same world size already went through a server-side barrier on the
    same key (its counter is complete and not yet deleted): this group's ranks would pass at
    once without waiting for each other. They are told of the collision instead."""
    from torch_ctrl import capabilities

    if not capabilities.BARRIER:
        pytest.skip("no server-side barrier in this torch: the generic path counts arrivals itself")
    stores = Stores("tcp")
    stores.client(9).add(f"{K.op_prefix(2, 'shared', -1)}/{K.BARRIER}", 2)  # the other group's 2 ranks
    coll = make(impl, stores.client(0), 0, 2)
    with pytest.raises(CollectiveError) as info:
        coll.barrier("shared", timeout=20)
    coll.close()
    text = str(info.value)
    assert "3 arrivals in a group of 2" in text and "another group uses the same store" in text, text


@pytest.mark.timeout(60)
@pytest.mark.skipif(not capabilities.tcpstore_path(False), reason="this torch's TCPStore has no server-side barrier")
@pytest.mark.parametrize("forged", [b"+7", b" 7", b"1_0", b"99999999999999999999", b"0x7"])
def test_a_forged_sum_entry_fails_both_twins_alike(forged: bytes) -> None:
    """An all_sum log entry Python's int() would take (or wrap) but the C++ twin would not:
    every rank of a mixed group raises the same one-line error naming the log, none returns."""
    stores = Stores("tcp")
    raw = stores.client(9)
    prefix = K.op_prefix(3, "forged", -1)
    raw.append(f"{prefix}/{K.LOG}", K.frame(2, K.TAG_DATA + forged))  # rank 2's entry, forged
    threading.Thread(target=raw.barrier, args=(f"{prefix}/{K.BARRIER}", 3), daemon=True).start()  # and its arrival
    impls = ["cpp", "python"] if HAVE_CPP else ["python", "python"]

    def body(rank: int) -> str:
        coll = make(impls[rank], stores.client(rank), rank, 3)
        try:
            return f"returned {coll.all_sum('forged', 1, timeout=20)}"
        except CollectiveError as exc:
            return str(exc)
        finally:
            coll.close()

    texts = run_ranks(2, body)
    assert texts[0] == texts[1].replace("rank 1", "rank 0"), texts
    assert f"{prefix}/{K.LOG}: {K.BAD_VALUE}" in texts[0] and "\n" not in texts[0], texts


@pytest.mark.timeout(60)
@pytest.mark.parametrize("impl", [i for i in IMPLS if i != "mixed"])
@pytest.mark.parametrize("kind", ["tcp", "prefix", "hash", "file"])
@pytest.mark.parametrize("op", ["broadcast_recv", "scatter_recv"])
def test_a_chunked_value_whose_chunks_never_come_is_one_line_naming_the_key(impl: str, kind: str, op: str) -> None:
    """A well-formed chunk count (``C3``) with no chunks behind it: torch_ctrl writes chunks
    before the value that names them, so this was not written by it, and the chunks will never
    come. The reader raises one CollectiveError line naming the key at once (not at its
    deadline, and not torch's own wait-timeout text)."""
    stores = Stores(kind)
    coll = make(impl, stores.client(1), 1, 2)
    field = "d" if op == "broadcast_recv" else "r1"
    key = f"{K.op_prefix(2, 'nochunks', -1)}/{field}"
    stores.client(0).set(key, b"C3")
    started = time.monotonic()
    with pytest.raises(CollectiveError) as info:
        getattr(coll, op)("nochunks", timeout=30)
    took = time.monotonic() - started
    coll.close()
    assert took < 5, f"{took:.1f} s: the reader waited for chunks that were never written"
    text = str(info.value)
    assert type(info.value) is CollectiveError and "\n" not in text, text
    assert text.endswith(f"{key}: {K.BAD_VALUE}"), text
