"""The protocol's key layout and value encodings: the one place that defines them.

Every store key torch_ctrl writes has the form::

    torch_ctrl/2/w{world_size}/{token}/{field}

* ``1`` is the protocol version (bumped on any incompatible change).
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

Group-wide keys (abort notice, heartbeats) live under ``torch_ctrl/2/w{world_size}/_``.
The C++ twin of this module is ``csrc/keys.h``; keep them identical.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable

PROTOCOL = "torch_ctrl/2"
MAX_TOKEN = 160

# Fields of one collective.
ARRIVE = "n"  # arrival counter (add); native TCPStore barrier counter
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
    """``torch_ctrl/2/w{N}/{token}``: the prefix of one collective's keys."""
    return f"{group_root(world_size)}/{token(key, seq)}"


def field(prefix: str, name: str) -> str:
    """One key of a collective."""
    return f"{prefix}/{name}"


def rank_slot(prefix: str, rank: int) -> str:
    """Per-rank slot of a collective (gather, scatter): ``{prefix}/r{rank}``."""
    return f"{prefix}/r{rank}"


def group_key(world_size: int, name: str) -> str:
    """Group-wide key (abort notice, heartbeats)."""
    return f"{group_root(world_size)}/_/{name}"


def abort_key(world_size: int) -> str:
    """The group's abort notice: ``b"{rank}:{reason}"``, written once (compare_set from empty)."""
    return group_key(world_size, "abort")


def parse_notice(notice: bytes) -> tuple[int, str]:
    """``(rank, reason)`` of an abort notice; rank -1 when unreadable."""
    rank, _, reason = notice.decode("utf-8", "replace").partition(":")
    return (int(rank) if rank.lstrip("-").isdigit() else -1), reason


def chunk_key(key: str, index: int) -> str:
    """Key of chunk ``index`` of the value stored at (or logged under) ``key``."""
    return f"{key}/c{index}"


def frame_key(log_key: str, rank: int) -> str:
    """Virtual key of ``rank``'s frame in a log: its chunks live under it."""
    return f"{log_key}/{rank}"


def pack(key: str, payload: bytes) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Tagged value for ``payload`` at ``key``, and the chunk keys to write first."""
    if len(payload) <= CHUNK:
        return TAG_DATA + payload, []
    chunks = [(chunk_key(key, i), payload[off : off + CHUNK]) for i, off in enumerate(range(0, len(payload), CHUNK))]
    return TAG_CHUNKS + str(len(chunks)).encode(), chunks


def chunk_count(value: bytes) -> int:
    """Number of chunks a ``TAG_CHUNKS`` value refers to."""
    return int(value[1:])


def frame(rank: int, payload: bytes) -> bytes:
    """One log entry: ``b"{rank}:{len}:" + payload``; rank -1 marks an abort notice."""
    return b"%d:%d:" % (rank, len(payload)) + payload


def parse_frames(log: bytes) -> list[tuple[int, bytes]]:
    """Split a log into ``(rank, payload)`` entries, in append order."""
    out: list[tuple[int, bytes]] = []
    pos, end = 0, len(log)
    while pos < end:
        c1 = log.index(b":", pos)
        c2 = log.index(b":", c1 + 1)
        rank, size = int(log[pos:c1]), int(log[c1 + 1 : c2])
        start = c2 + 1
        out.append((rank, bytes(log[start : start + size])))
        pos = start + size
    return out


_DECIMAL = re.compile(rb"-?[0-9]{1,19}")
BAD_VALUE = "unexpected value in the store (not written by torch_ctrl?)"


def parse_total(value: bytes, error: Callable[[], Exception]) -> int:
    """A published all_sum total: ``-?[0-9]+`` within int64 (the C++ twin's ``from_chars``
    rule); anything else raises ``error()``."""
    if _DECIMAL.fullmatch(value):
        total = int(value)
        if -(1 << 63) <= total < (1 << 63):
            return total
    raise error()


def parse_names(log: bytes) -> set[int]:
    """Ranks listed in a NAMES log (``b"0,3,"``)."""
    return {int(x) for x in log.split(b",") if x}
