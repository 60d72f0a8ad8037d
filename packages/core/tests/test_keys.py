import hashlib
import struct
import subprocess
import sys

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvdepot.core import InvalidArgumentError, KeyChain, Namespace, chunk_keys, pack_tokens

GOLDEN = [
    (
        Namespace(model="kvdepot/golden"),
        list(range(512)),
        256,
        "32bd9436f7c24c130376984930f0b958ff6ffc5a638bed94f3189d26d214dd87",
        [
            "50d406c9e27d6980124c8fe8f16cc779abe720557cfe8729f2cad61c035e7d3c",
            "64808dd049ef29e6de9cfbb6dadc2d9ce53a4a3a020b301bf2f46a84d5588754",
        ],
    ),
    (
        Namespace(
            model="kvdepot/golden",
            layout="fp32:L4:B128:8192",
            kv_world_size=2,
            kv_rank=1,
            lora="adapter-a",
            cache_salt="tenant-1",
            extra=(b"\x01" * 32,),
        ),
        list(range(1000, 1032)),
        16,
        "a8df1682316db6de14a87faad6b8ca3dc42901f8e4b5cd96eb37f1bb8a0cd7b7",
        [
            "2233e618bd56ac087cbcd82393dc1cf625da1ec86db74197892283dc60ae4b52",
            "c87e4132efb4c2315349805fd77781e8c78302fbd3b9c33d901c8d3cc5f0739f",
        ],
    ),
    (
        Namespace(model="kvdepot/golden", cache_salt="tenant-1"),
        list(range(512)),
        256,
        "11f379ef89e69365a224a96c4c7f94375439fb42f5910ba4d62b8edbbf195a71",
        [
            "841a4abdd4a7c4be5158a6a87f8bfd5b2b560601ed1e6c035ce94c30bcd2c670",
            "46bcb2f5c6face57c28ab3d09e0eb211b7cb520357afd09176bca1bac0c77729",
        ],
    ),
]


def _spec_seed(ns: Namespace) -> bytes:
    """The namespace seed written straight from the spec in docs/core.md."""

    def field(tag: bytes, value: bytes) -> bytes:
        return tag + struct.pack("<I", len(value)) + value

    data = b"kvdepot/namespace/v1"
    data += field(b"model", ns.model.encode()) + field(b"layout", ns.layout.encode())
    data += field(b"kv_world_size", struct.pack("<I", ns.kv_world_size))
    data += field(b"kv_rank", struct.pack("<I", ns.kv_rank))
    data += field(b"lora", ns.lora.encode()) + field(b"cache_salt", ns.cache_salt.encode())
    data += field(b"extra", struct.pack("<I", len(ns.extra)))
    data += b"".join(field(b"digest", d) for d in ns.extra)
    return hashlib.sha256(data).digest()


@pytest.mark.parametrize(("ns", "tokens", "chunk_size", "seed", "keys"), GOLDEN)
def test_golden_vectors(ns, tokens, chunk_size, seed, keys):
    """Keys equal the published golden vectors, byte for byte."""
    assert ns.seed.hex() == seed
    assert [k.hex() for k in chunk_keys(ns, tokens, chunk_size)] == keys


@pytest.mark.parametrize(("ns", "tokens", "chunk_size", "seed", "keys"), GOLDEN)
def test_golden_vectors_match_spec(ns, tokens, chunk_size, seed, keys):
    """An independent implementation of the documented spec gives the same keys."""
    prev = _spec_seed(ns)
    assert prev.hex() == seed
    for i, key in enumerate(keys):
        chunk = tokens[i * chunk_size : (i + 1) * chunk_size]
        prev = hashlib.sha256(prev + struct.pack(f"<{len(chunk)}I", *chunk)).digest()
        assert prev.hex() == key


def test_keys_stable_across_processes():
    """Another interpreter with a different hash seed computes the same keys."""
    code = (
        "from kvdepot.core import Namespace, chunk_keys;"
        "print(chunk_keys(Namespace(model='kvdepot/golden'), list(range(512)), 256)[1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "12345"}
    )
    assert out.stdout.strip() == GOLDEN[0][4][1]


def test_only_full_chunks_are_keyed():
    """A partial trailing chunk gets no key."""
    ns = Namespace(model="m")
    assert len(chunk_keys(ns, list(range(255)), 256)) == 0
    assert len(chunk_keys(ns, list(range(767)), 256)) == 2


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200),
    cuts=st.lists(st.integers(0, 200), max_size=6),
    chunk_size=st.integers(1, 17),
)
def test_incremental_equals_one_shot(tokens, cuts, chunk_size):
    """Extending a chain as tokens grow gives the keys of hashing everything at once."""
    ns = Namespace(model="m")
    chain = KeyChain(ns, chunk_size)
    for cut in sorted(cuts):
        chain.update(tokens[:cut])
    chain.update(tokens)
    assert chain.keys() == chunk_keys(ns, tokens, chunk_size)


def test_incremental_does_not_rehash_earlier_chunks():
    """Later updates hash only the new chunks: earlier keys are kept as they were."""
    chain = KeyChain(Namespace(model="m"), 4)
    assert chain.update(list(range(8))) == 2
    first = list(chain.keys())
    assert chain.update(list(range(9))) == 0
    assert chain.update(list(range(12))) == 1
    assert chain.keys()[:2] == first
    assert chain.num_tokens_hashed == 12


FIELD_CHANGES = {
    "model": "other-model",
    "layout": "bf16:L4",
    "kv_world_size": 4,
    "kv_rank": 1,
    "lora": "adapter",
    "cache_salt": "salt",
    "extra": (b"\x02" * 32,),
    "epoch": "after-reset",
}


@pytest.mark.parametrize("field", sorted(FIELD_CHANGES))
def test_every_namespace_field_changes_every_key(field):
    """Changing any single namespace field changes every chunk key."""
    base = Namespace(model="m", kv_world_size=2)
    changed = attrs.evolve(base, **{field: FIELD_CHANGES[field]})
    tokens = list(range(64))
    a, b = chunk_keys(base, tokens, 16), chunk_keys(changed, tokens, 16)
    assert len(a) == 4
    assert all(x != y for x, y in zip(a, b, strict=True))


_texts = st.text(max_size=12)
_namespaces = st.builds(
    Namespace,
    model=_texts,
    layout=_texts,
    kv_world_size=st.just(4),
    kv_rank=st.integers(0, 3),
    lora=_texts,
    cache_salt=_texts,
    extra=st.lists(st.binary(min_size=32, max_size=32), max_size=2).map(tuple),
    epoch=_texts,
)


@given(a=_namespaces, b=_namespaces)
def test_namespaces_share_keys_exactly_when_equal(a, b):
    """Any difference in model, weights, layout, rank, LoRA, salt, digests or epoch gives other keys; equal
    namespaces, built anywhere, give equal keys."""
    tokens = list(range(32))
    same = chunk_keys(a, tokens, 16) == chunk_keys(b, tokens, 16)
    assert same == (a == b)
    rebuilt = Namespace(**{f.name: getattr(a, f.name) for f in attrs.fields(Namespace) if f.init})
    assert chunk_keys(rebuilt, tokens, 16) == chunk_keys(a, tokens, 16)


def test_multi_namespace_chain_matches_single():
    """One chain over several ranks gives each rank its own single-namespace keys."""
    spaces = [Namespace(model="m", kv_world_size=2, kv_rank=r) for r in range(2)]
    chain = KeyChain(spaces, 8)
    tokens = list(range(40))
    chain.update(tokens)
    for rank, ns in enumerate(spaces):
        assert chain.keys(rank) == chunk_keys(ns, tokens, 8)
    assert chain.keys(0)[0] != chain.keys(1)[0]


@pytest.mark.parametrize("bad", [[-1], [2**32], ["a"], [1.5]])
def test_bad_token_ids_raise_typed_error(bad):
    """Token ids outside uint32 raise InvalidArgumentError, not an obscure low-level error."""
    with pytest.raises(InvalidArgumentError):
        pack_tokens(bad)


@pytest.mark.parametrize("kwargs", [{"kv_world_size": 0}, {"kv_rank": 2, "kv_world_size": 2}, {"kv_rank": -1}])
def test_bad_namespace_raises(kwargs):
    """A rank outside its world is refused with a typed error."""
    with pytest.raises(InvalidArgumentError):
        Namespace(model="m", **kwargs)


@pytest.mark.parametrize("chunk_size", [0, -4, True, 2.0])
def test_bad_chunk_size_raises(chunk_size):
    """A chunk size that is not a positive int is refused."""
    with pytest.raises(InvalidArgumentError):
        KeyChain(Namespace(model="m"), chunk_size)


def test_extra_must_be_bytes():
    """Extra digests must be bytes so they encode the same everywhere."""
    with pytest.raises(InvalidArgumentError):
        Namespace(model="m", extra=("text",))  # type: ignore[arg-type]


_digests = st.binary(min_size=32, max_size=32)


@given(
    position=st.integers(0, 63),
    digest=_digests,
    other=_digests,
    tokens=st.lists(st.integers(0, 2**32 - 1), min_size=64, max_size=64),
)
def test_a_mark_changes_the_keys_from_its_chunk_on_and_no_earlier(position, digest, other, tokens):
    """A multimodal input keys only the chunks at and after its position: the text before it is
    shared with a request without it or with another input there, and every later key differs."""
    ns = Namespace(model="m")
    plain = chunk_keys(ns, tokens, 16)
    marked = chunk_keys(ns, tokens, 16, [(position, digest)])
    first = position // 16
    assert marked[:first] == plain[:first]
    assert all(a != b for a, b in zip(marked[first:], plain[first:], strict=True))
    another = chunk_keys(ns, tokens, 16, [(position, other)])
    assert (another[first:] == marked[first:]) == (other == digest)
    if position + 16 < 64:  # the same input one chunk later leaves this chunk shared
        later = chunk_keys(ns, tokens, 16, [(position + 16, digest)])
        assert later[first] == plain[first] != marked[first]


def test_marks_are_hashed_incrementally_like_tokens():
    """A chain updated token by token with marks gives the one-shot keys."""
    marks = [(5, b"\x01" * 32), (21, b"\x02" * 32), (22, b"\x03" * 32)]
    tokens = list(range(48))
    chain = KeyChain(Namespace(model="m"), 8, marks)
    for end in range(1, 49):
        chain.update(tokens[:end])
    assert chain.keys() == chunk_keys(Namespace(model="m"), tokens, 8, marks)


@pytest.mark.parametrize("mark", [(-1, b"\x01" * 32), (0, b"short"), (True, b"\x01" * 32), ("0", b"\x01" * 32)])
def test_bad_marks_raise_typed_error(mark):
    """A mark needs a non-negative int position and a 32-byte digest."""
    with pytest.raises(InvalidArgumentError):
        KeyChain(Namespace(model="m"), 8, [mark])
