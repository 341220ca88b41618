"""The protocol's key layout and value encodings: the one place that defines them.

Every store key torch_ctrl writes has the form::

    torch_ctrl/3/w{world_size}/{token}/{field}

* ``3`` is the protocol version (bumped on any incompatible change).
* ``w{world_size}`` separates groups of different sizes sharing one store.
* ``{token}`` names one collective:

  - ``k`` + the user's key, percent-encoded (every byte outside ``[A-Za-z0-9._-]``
    becomes ``%XX``), so no user key can contain ``/`` and no two user keys map to
    the same token;
  - ``h`` + the SHA-256 of the user's key when the encoded key is longer than
    :data:`MAX_TOKEN`, to keep store keys short;
  - ``s`` + a per-instance sequence number for keyless calls (``key=None``).

  The three prefixes are disjoint, so user keys never collide with automatic
  keys or with each other.
* ``{field}`` is one of the short names below.

Group-wide keys (abort notice, heartbeats) live under ``torch_ctrl/3/w{world_size}/_``.
The C++ twin of this module is ``csrc/keys.h``; keep them identical.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Callable

PROTOCOL = "torch_ctrl/3"
MAX_TOKEN = 160

# Fields of one collective.
ARRIVE = "n"  # arrival counter of the generic path (add)
BARRIER = "b"  # counter of the TCPStore path's server-side barrier (never "n": see counter())
DONE = "d"  # done flag / broadcast payload (tagged value)
LOG = "g"  # append-only log of frames (all_gather, all_sum)
NAMES = "a"  # append-only log of "rank," written by ranks blocked past the grace period
EXIT = "x"  # exit counter: the rank that brings it to the expected count deletes the keys
SUM = "s"  # running total of a generic-path all_sum (add)

# Value tags: the first byte of every single-value key (and of every log frame's payload).
TAG_DATA = b"D"  # b"D" + payload
TAG_CHUNKS = b"C"  # b"C{n}": the payload is in n chunk keys "{key}/c{i}", written before this value
TAG_ABORT = b"A"  # b"A{rank}:{reason}"

# Largest payload stored inline; larger ones are split into chunks (TCPStore's libuv
# server rejects messages with a value over 8 MiB).
CHUNK = 4 << 20

# Added to a barrier counter to release native-barrier waiters on abort.
ABORT_BIAS = 1 << 40

# Heartbeat counters (liveness): every beat adds BEAT, and the first one also adds the rank's
# interval in milliseconds (at most BEAT - 1, over an hour), so that a reader gives each rank
# the silence its own interval allows: ranks of one group may beat at different intervals.
BEAT = 1 << 22

# compare_set with this expected value never matches a tagged value or a counter,
# so it reads a key without writing it (and returns MISSING when the key is absent).
MISSING = b"\x01"
NEVER = b"\x02"


def group_root(world_size: int) -> str:
    """Prefix of every key of the group of ``world_size`` ranks."""
    return f"{PROTOCOL}/w{world_size}"


_UNSAFE = re.compile("[^A-Za-z0-9._-]")
_SAFE_ASCII = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")
# ASCII keys (the usual case) are escaped by one str.translate call.
_ASCII_TABLE = {c: f"%{c:02X}" for c in range(128) if chr(c) not in _SAFE_ASCII}


def _percent(match: re.Match[str]) -> str:
    return f"%{ord(match.group()):02X}"


def escape(key: str) -> str:
    """Percent-encode ``key`` (UTF-8) so that it contains no ``/``: injective."""
    if key.isascii():
        return key.translate(_ASCII_TABLE)
    # Each UTF-8 byte as one latin-1 character, so the regex sees bytes.
    raw = key.encode("utf-8", "surrogatepass").decode("latin-1")
    return _UNSAFE.sub(_percent, raw)


def token(key: str | None, seq: int) -> str:
    """The token naming one collective: from the user's key, or the sequence number."""
    if key is None:
        return f"s{seq}"
    enc = escape(key)
    if len(enc) > MAX_TOKEN:
        return "h" + hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
    return "k" + enc


def op_prefix(world_size: int, key: str | None, seq: int) -> str:
    """``torch_ctrl/3/w{N}/{token}``: the prefix of one collective's keys."""
    return f"{group_root(world_size)}/{token(key, seq)}"


def field(prefix: str, name: str) -> str:
    """One key of a collective."""
    return f"{prefix}/{name}"


def counter(native_barrier: bool) -> str:
    """The arrival counter of a barrier, all_gather or all_sum: ``b`` on the TCPStore path
    (the server-side barrier's), ``n`` on the generic path (``add``). Two names, so that ranks
    of one group that take different paths (torch releases on both sides of 2.12) never count
    on one counter: they time out saying so (:data:`OTHER_PATH`), where a shared counter would
    let some of them pass a barrier early or sum without the others' values."""
    return BARRIER if native_barrier else ARRIVE


# The detail of a timeout when a key of the other path shows ranks that took it.
OTHER_PATH = (
    "ranks arrived on the other store path: every rank of a group needs a torch with "
    "TCPStore.barrier (2.12 or newer), or every rank one without"
)

# The detail of a timeout when keys of the same op exist under other world sizes (a rank given
# the wrong world_size joins a group of its own): {sizes} is "3" or "3, 4".
OTHER_WORLD_SIZES = (
    "this op's key is also in use by ranks given world_size {sizes}: every rank of a group "
    "must pass the same world_size"
)


def rank_slot(prefix: str, rank: int) -> str:
    """Per-rank slot of a collective (gather, scatter): ``{prefix}/r{rank}``."""
    return f"{prefix}/r{rank}"


def rank_slots(prefix: str, world_size: int, skip: int = -1) -> list[str]:
    """The slots of every rank but ``skip`` (-1: of all), in rank order."""
    return [f"{prefix}/r{r}" for r in range(world_size) if r != skip]


def group_key(world_size: int, name: str) -> str:
    """Group-wide key (abort notice, heartbeats)."""
    return f"{group_root(world_size)}/_/{name}"


def abort_key(world_size: int) -> str:
    """The group's abort notice: ``b"{rank}:{reason}"``, written once (compare_set from empty)."""
    return group_key(world_size, "abort")


def reader_key(world_size: int) -> str:
    """Which rank reads the group's heartbeat counters for everyone blocked (liveness):
    ``b"{rank}:{n}"``, ``n`` counting that rank's reads (see ``parse_reader``)."""
    return group_key(world_size, "reader")


def parse_notice(notice: bytes) -> tuple[int, str]:
    """``(rank, reason)`` of an abort notice; rank -1 when unreadable."""
    head, _, tail = notice.partition(b":")
    rank = _int64(head)
    return (rank if rank is not None and -1 <= rank < (1 << 31) else -1), tail.decode("utf-8", "replace")


def chunk_key(key: str, index: int) -> str:
    """Key of chunk ``index`` of the value stored at (or logged under) ``key``."""
    return f"{key}/c{index}"


def entry_count(key: str) -> str:
    """On a store without ``compare_set``: the counter (``add``) of the entries appended to
    ``key`` (or the ticket of a write-once ``key``): ``{key}/e``."""
    return f"{key}/e"


def entry(key: str, index: int) -> str:
    """On a store without ``compare_set``: entry ``index`` (from 1) appended to ``key``."""
    return f"{key}/e{index}"


def frame_key(log_key: str, rank: int) -> str:
    """Virtual key of ``rank``'s frame in a log: its chunks live under it."""
    return f"{log_key}/{rank}"


def pack(key: str, payload: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Tagged value for ``payload`` at ``key``, and the chunk keys to write first."""
    if len(payload) <= CHUNK:
        return TAG_DATA + payload, []
    chunks = [(chunk_key(key, i), payload[off : off + CHUNK]) for i, off in enumerate(range(0, len(payload), CHUNK))]
    return TAG_CHUNKS + str(len(chunks)).encode(), chunks


def frame(rank: int, payload: bytes) -> bytes:
    """One log entry: ``b"{rank}:{len}:" + payload``; rank -1 marks an abort notice."""
    return b"%d:%d:" % (rank, len(payload)) + payload


# ---------------------------------------------------------------------------- decoding
# Everything read back from the store is decoded here, and checked before anything is
# allocated from it: a value torch_ctrl could not have written (a buggy or hostile client,
# another group on the same keys) is a DecodeError, never a huge allocation or silently wrong
# data. ``csrc/keys.cpp`` applies the same rules; test/test_decode.py fuzzes the twins against
# each other through ``decode()`` and ``torch_ctrl._C._decode``: the same bytes give the same
# value or the same error message.

MAX_CHUNKS = 4096  # a chunked payload is at most MAX_CHUNKS * CHUNK bytes (16 GiB)
BAD_VALUE = "unexpected value in the store (not written by torch_ctrl?)"
COLLISION = (
    "another group uses the same store and keys, or two processes were given the same rank "
    "(give each group its own PrefixStore, and each process its own rank)"
)
_INT64 = re.compile(rb"-?[0-9]{1,19}")
_SIZE = re.compile(rb"[0-9]{1,20}")
# A log frame's head, b"{rank}:{size}:": what _INT64 and _SIZE accept, each up to its colon.
_FRAME_HEAD = re.compile(rb"(-?[0-9]{1,19}):([0-9]{1,20}):")


class DecodeError(ValueError):
    """A value read from the store that torch_ctrl could not have written; the message says what."""


def wrap_int64(value: int) -> int:
    """Two's-complement wrap to signed 64 bits: how every all_sum total wraps."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _int64(text: bytes) -> int | None:
    if _INT64.fullmatch(text):
        value = int(text)
        if -(1 << 63) <= value < (1 << 63):
            return value
    return None


def chunk_count(value: bytes) -> int:
    """Number of chunks a ``TAG_CHUNKS`` value ``b"C{n}"`` refers to: ``2 <= n <= MAX_CHUNKS``
    (one chunk would have been stored inline)."""
    digits = value[1:]
    if _SIZE.fullmatch(digits) and len(digits) <= 5 and 2 <= int(digits) <= MAX_CHUNKS:
        return int(digits)
    raise DecodeError("bad chunk count")


def join_chunks(parts: list[bytes]) -> bytes:
    """A chunked payload from its chunks: every chunk but the last is exactly ``CHUNK`` bytes,
    the last at most that."""
    if any(len(p) != CHUNK for p in parts[:-1]) or (parts and not 0 < len(parts[-1]) <= CHUNK):
        raise DecodeError("bad chunk size")
    return b"".join(parts)


def counter_value(value: bytes) -> int | None:
    """A counter's value, or None when it is not a decimal int64 (what :func:`parse_counter`
    refuses)."""
    return _int64(value)


def parse_counter(value: bytes) -> int:
    """A counter written by the store's ``add``: a decimal int64."""
    number = counter_value(value)
    if number is None:
        raise DecodeError("bad counter")
    return number


def first_beat(interval: float) -> int:
    """What a rank's first heartbeat adds to its counter: one ``BEAT`` and its interval (ms)."""
    return BEAT + min(BEAT - 1, max(1, math.ceil(interval * 1000)))


def beat_interval(value: bytes) -> float | None:
    """The interval, in seconds, a heartbeat counter's rank declared (see ``first_beat``);
    ``None`` when the value is not a non-negative decimal int64 or declares none."""
    number = _int64(value)
    if number is None or number < 0 or number % BEAT == 0:
        return None
    return (number % BEAT) / 1000


def parse_total(value: bytes, error: Callable[[], Exception]) -> int:
    """A published all_sum total: a decimal int64 (the C++ twin's ``from_chars`` rule);
    anything else raises ``error()``."""
    number = _int64(value)
    if number is None:
        raise error()
    return number


def parse_frames(log: bytes, world_size: int | None = None) -> list[tuple[int, bytes]]:
    """Split a log into ``(rank, payload)`` entries, in append order. Each frame is
    ``{rank}:{size}:{payload}`` with a decimal rank (-1 for an abort notice, else in
    ``[0, world_size)`` when given) and a size within the bytes left; a rank logged twice means
    another group writes the same keys."""
    out: list[tuple[int, bytes]] = []
    seen: set[int] = set()
    pos, end = 0, len(log)
    head = _FRAME_HEAD.match  # one match per frame: every rank decodes all N frames
    while pos < end:
        m = head(log, pos)
        if m is None:
            raise DecodeError("malformed log entry")
        rank, start = int(m[1]), m.end()
        size = int(m[2])
        if not -(1 << 63) <= rank < (1 << 63) or size > end - start:
            raise DecodeError("malformed log entry")
        if rank != -1 and (rank < 0 or (world_size is not None and rank >= world_size)):
            raise DecodeError(f"frame of rank {rank} in a group of {world_size}")
        if rank >= 0:
            if rank in seen:
                raise DecodeError(f"two frames of rank {rank}: {COLLISION}")
            seen.add(rank)
        out.append((rank, bytes(log[start : start + size])))
        pos = start + size
    return out


def parse_names(log: bytes, world_size: int | None = None) -> set[int]:
    """Ranks listed in a NAMES log (``b"0,3,"``); entries that are not a rank of the group are
    ignored (the log only names missing ranks in errors)."""
    out = set()
    for item in log.split(b","):
        rank = _int64(item) if item else None
        if rank is not None and rank >= 0 and (world_size is None or rank < world_size):
            out.add(rank)
    return out


def parse_reader(value: bytes, world_size: int) -> int | None:
    """The rank named by a ``reader_key`` value ``b"{rank}:{n}"`` (two decimal int64s, the rank
    in ``[0, world_size)``); ``None`` for anything else (the value is then only compared)."""
    head, colon, tail = value.partition(b":")
    rank = _int64(head)
    if not colon or rank is None or _int64(tail) is None or not 0 <= rank < world_size:
        return None
    return rank


def other_world_sizes(names: list[str], world_size: int, token: str) -> list[int]:
    """The world sizes, other than ``world_size``, of groups with keys of the collective
    ``token`` among ``names`` (a store's ``list_keys``, relative to the group's namespace):
    ``torch_ctrl/3/w{M}/{token}/...``, ``M`` a decimal in ``1 <= M < 2**31``. Names that do
    not have that form are ignored (the store may hold anything)."""
    head = PROTOCOL + "/w"
    found = set()
    for name in names:
        if not name.startswith(head):
            continue
        slash = name.find("/", len(head))
        digits = name[len(head) : slash]
        if slash < 0 or not name.startswith(token + "/", slash + 1):
            continue
        size = _int64(digits.encode("latin-1")) if digits.isascii() and digits.isdigit() else None
        if size is not None and 1 <= size < 1 << 31 and size != world_size:
            found.add(size)
    return sorted(found)


def decode(kind: str, data: bytes, world_size: int) -> object:
    """One decoder by name, for the twin fuzz tests: ``chunks``, ``counter``, ``total``,
    ``frames``, ``names``, ``reader``, ``beat`` or ``world_sizes``; raises DecodeError like the decoder itself."""
    if kind == "chunks":
        return chunk_count(data)
    if kind == "counter":
        return parse_counter(data)
    if kind == "chunk_sizes":  # data: the sizes, as decimal lines (the chunks themselves are big)
        sizes = [int(x) for x in data.split()] if data.strip() else []
        return len(join_chunks([b"x" * n for n in sizes]))
    if kind == "total":
        return parse_total(data, lambda: DecodeError(BAD_VALUE))
    if kind == "frames":
        return parse_frames(data, world_size)
    if kind == "names":
        return sorted(parse_names(data, world_size))
    if kind == "reader":
        return parse_reader(data, world_size)
    if kind == "beat":
        return beat_interval(data)
    if kind == "world_sizes":  # data: the token, then one key name per line
        token_, *names = data.decode("latin-1").split("\n")
        return other_world_sizes(names, world_size, token_)
    raise ValueError(f"unknown decoder {kind!r}")
