"""Key layout: escaping is injective, user keys never collide with each other or internal keys."""

from __future__ import annotations

from helpers import Stores, run_group
from hypothesis import given, settings
from hypothesis import strategies as st

import torch_ctrl
from torch_ctrl import keys as K

HAVE_CPP = torch_ctrl.backend() == "cpp"


@given(st.text(), st.text())
def test_escape_is_injective_and_slash_free(a: str, b: str) -> None:
    ea, eb = K.escape(a), K.escape(b)
    assert "/" not in ea and ":" not in ea
    assert (ea == eb) == (a == b)


@given(st.one_of(st.none(), st.text()), st.integers(0, 10**9), st.one_of(st.none(), st.text()), st.integers(0, 10**9))
def test_tokens_never_collide(k1, s1, k2, s2) -> None:
    t1, t2 = K.token(k1, s1), K.token(k2, s2)
    same_op = k1 == k2 and (k1 is not None or s1 == s2)
    assert (t1 == t2) == same_op
    assert "/" not in t1 and len(t1) <= K.MAX_TOKEN + 1


@settings(max_examples=200)
@given(st.text(min_size=0, max_size=300))
def test_op_keys_are_under_the_op_prefix(key: str) -> None:
    prefix = K.op_prefix(4, key, 0)
    assert prefix.startswith("torch_ctrl/3/w4/")
    assert prefix.count("/") == 3


def test_frames_roundtrip() -> None:
    log = K.frame(0, b"a:b:c") + K.frame(12, b"") + K.frame(-1, b"3:disk full")
    assert K.parse_frames(log) == [(0, b"a:b:c"), (12, b""), (-1, b"3:disk full")]


def test_pack_chunks_large_values() -> None:
    head, chunks = K.pack("p/d", b"x" * (K.CHUNK * 2 + 1))
    assert head == b"C3" and [k for k, _ in chunks] == ["p/d/c0", "p/d/c1", "p/d/c2"]
    assert K.pack("p/d", b"small") == (b"Dsmall", [])


if HAVE_CPP:

    @settings(max_examples=300)
    @given(st.one_of(st.none(), st.text(max_size=400)), st.integers(0, 10**6))
    def test_cpp_and_python_key_layout_agree(key, seq) -> None:
        from torch_ctrl import _C

        assert _C._op_prefix(4, key, seq) == K.op_prefix(4, key, seq)


TRICKY = ["a", "a/0", "a/num_members", "a/last_members", "", "a/n", "a/d", "a%2F0", "ключ/🔑", "k" * 5000, "a/r0", "s0"]


def test_tricky_keys_do_not_interfere(impl: str) -> None:
    """Every tricky key used at once, each op seeing only its own data."""
    stores, world = Stores("tcp"), 3

    def fn(coll, rank):
        out = {}
        for i, key in enumerate(TRICKY):
            out[key] = coll.all_gather(key, f"{i}:{rank}", 30)
        coll.barrier()  # automatic key "s0" must not meet user key "s0"
        return out

    for res in run_group(impl, stores, world, fn):
        for i, key in enumerate(TRICKY):
            assert res[key] == [f"{i}:{r}".encode() for r in range(world)]
