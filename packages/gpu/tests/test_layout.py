"""KVLayout: recognising engine layouts, their geometry and fingerprint, and refusing the rest."""

from __future__ import annotations

import pytest
import torch

from kvdepot.core import InvalidArgumentError, KVDepotError
from kvdepot.gpu import KVLayout, UnsupportedLayoutError
from kvdepot.gpu.testing import LAYOUT_NAMES, Case, block_bytes


def layout_of(case: Case) -> KVLayout:
    return KVLayout.from_kv_caches(case.kv, case.block_size, backend_hint=case.hint)


def test_every_layout_reports_its_geometry(case: Case) -> None:
    """Block count, block size, layers, dtype and bytes per block match the tensors."""
    layout = layout_of(case)
    assert layout.num_blocks == case.num_blocks
    assert layout.num_layers == len(case.layers)
    assert layout.layer_names == tuple(case.layers)
    assert layout.dtype == next(iter(case.kv.values())).dtype
    per_block = sum(block_bytes(case, layer, 0).numel() for layer in case.layers)
    assert layout.bytes_per_block == per_block
    assert layout.chunk_bytes(5) == 5 * per_block


@pytest.mark.parametrize(
    ("name", "kind", "block_size"),
    [("cpu", "bhnc", 4), ("flash_attn", "flash_attn", 4), ("flashinfer", "flashinfer", 4), ("mla", "mla", 4)],
)
def test_backend_layouts_are_named_and_sized(make_case, name: str, kind: str, block_size: int) -> None:
    """Each engine backend's tensors are recognised as that backend's layout with the right block size."""
    case = make_case(name, torch.float16)
    layout = layout_of(case)
    assert layout.kind == kind
    assert layout.block_size == block_size


def test_layers_in_one_storage_are_one_plane_group(make_case) -> None:
    """Layers carved from one storage at a uniform stride are copied by one view, interleaved or not."""
    for name in ("shared_layer_major", "shared_block_major", "shared_permuted", "shared_flash"):
        layout = layout_of(make_case(name, torch.float16))
        assert len(layout.groups) == 1, name
        assert layout.groups[0].num_planes == 3


def test_separate_tensors_are_separate_groups(make_case) -> None:
    """Layers in separate allocations get one group each."""
    layout = layout_of(make_case("cpu", torch.float16))
    assert [g.num_planes for g in layout.groups] == [1, 1, 1]


def test_aliased_layers_count_once(make_case) -> None:
    """A layer that reuses another layer's tensor is recorded as an alias, not copied twice."""
    layout = layout_of(make_case("aliased", torch.float16))
    assert layout.num_layers == 3
    assert layout.aliases == {"model.layers.3.attn": "model.layers.1.attn"}


def test_kernel_blocks_merge_into_engine_blocks(make_case) -> None:
    """Dense kernel blocks that tile an engine block are merged when block_size says so."""
    case = make_case("kernel_blocks", torch.float16)
    layout = layout_of(case)
    assert layout.block_size == 8
    assert layout.num_blocks == 12
    unmerged = KVLayout.from_kv_caches(case.kv)
    assert unmerged.num_blocks == 24
    assert unmerged.fingerprint() != layout.fingerprint()


def test_block_size_that_does_not_tile_is_refused(make_case) -> None:
    """An engine block size that is not a whole number of kernel blocks is an error."""
    case = make_case("cpu", torch.float16)
    with pytest.raises(UnsupportedLayoutError, match="kernel blocks"):
        KVLayout.from_kv_caches(case.kv, 6)


def test_fingerprint_is_stable_and_names_what_bytes_depend_on(make_case) -> None:
    """Equal geometry gives equal fingerprints; dtype, layer count, block shape and memory order change it."""
    a = layout_of(make_case("cpu", torch.float16)).fingerprint()
    b = layout_of(make_case("cpu", torch.float16)).fingerprint()
    assert a == b
    assert "dtype=float16" in a
    assert "layers=3" in a
    assert "block_tokens=4" in a
    others = {
        layout_of(make_case("cpu", torch.bfloat16)).fingerprint(),
        layout_of(make_case("flash_attn", torch.float16)).fingerprint(),
        layout_of(make_case("shared_permuted", torch.float16)).fingerprint(),
        KVLayout.from_kv_caches(dict(list(make_case("cpu", torch.float16).kv.items())[:2])).fingerprint(),
    }
    assert a not in others
    assert len(others) == 4


def test_flash_and_flashinfer_need_a_hint_when_both_fit() -> None:
    """A [2, 2, ...] tensor fits flash-attention and flashinfer; without a hint it is refused, with one it is read."""
    t = torch.zeros(2, 2, 4, 2, 8)
    with pytest.raises(UnsupportedLayoutError, match="fits no single known layout") as info:
        KVLayout.from_kv_caches({"l0": t})
    assert info.value.shapes == {"l0": (2, 2, 4, 2, 8)}
    assert info.value.strides == {"l0": t.stride()}
    assert KVLayout.from_kv_caches({"l0": t}, backend_hint="FLASH_ATTN").kind == "flash_attn"
    assert KVLayout.from_kv_caches({"l0": t}, backend_hint="FLASHINFER").kind == "flashinfer"


def test_hint_that_contradicts_the_shape_is_refused(make_case) -> None:
    """A CPU hint on flash-attention tensors is an error, not a guess."""
    case = make_case("flash_attn", torch.float16)
    with pytest.raises(UnsupportedLayoutError):
        KVLayout.from_kv_caches(case.kv, backend_hint="CPU_ATTN")


def test_a_backend_kvdepot_does_not_name_takes_vllms_one_view(make_case) -> None:
    """A backend named nowhere in kvdepot (vLLM's TRITON_ATTN, FLEX_ATTENTION, ...) registers vLLM's
    [B, H, N, C] view, as every backend has since vLLM 0.26: that view is taken; any other shape is
    refused, and the message names the backends kvdepot knows."""
    assert KVLayout.from_kv_caches(make_case("cpu", torch.float16).kv, backend_hint="TRITON_ATTN").kind == "bhnc"
    with pytest.raises(UnsupportedLayoutError, match="not one kvdepot names"):
        KVLayout.from_kv_caches(make_case("flash_attn", torch.float16).kv, backend_hint="FLASH_ATN")


@pytest.mark.parametrize(
    "kv",
    [
        {"l0": torch.zeros(4, 8)},  # rank 2
        {"l0": torch.zeros(4, 2, 4, 2, 8, 1)},  # rank 6
        {"l0": torch.zeros(4, 2, 4, 8)[:, :, ::2]},  # a block with gaps
        {"l0": torch.zeros(1, 2, 4, 8).expand(4, 2, 4, 8)},  # every block the same bytes
        {"l0": torch.zeros(4, 2, 4, 8), "l1": torch.zeros(4, 2, 4, 8, dtype=torch.float16)},  # mixed dtypes
        {"l0": torch.zeros(4, 2, 4, 8), "l1": torch.zeros(5, 2, 4, 8)},  # mixed block counts
        {"l0": torch.zeros(4, 2, 4, 8), "l1": torch.zeros(6, 4, 8)},  # mixed kinds
        {"l0": "not a tensor"},
        {},
    ],
)
def test_unsupported_layouts_raise_a_typed_error(kv) -> None:
    """Anything kvdepot does not recognise raises UnsupportedLayoutError, which is a KVDepotError and ValueError."""
    with pytest.raises(UnsupportedLayoutError) as info:
        KVLayout.from_kv_caches(kv)
    assert isinstance(info.value, KVDepotError)
    assert isinstance(info.value, InvalidArgumentError)
    assert "docs/gpu.md" in str(info.value)


def test_overlapping_layers_are_refused() -> None:
    """Two layers whose blocks share bytes (and are not the same tensor) cannot be a layout."""
    buf = torch.zeros(8, 2, 4, 8)
    with pytest.raises(UnsupportedLayoutError, match="overlap"):
        KVLayout.from_kv_caches({"l0": buf[0:6], "l1": buf[2:8]})


def test_chunk_bytes_needs_a_positive_count(make_case) -> None:
    """chunk_bytes refuses zero, negatives and non-ints."""
    layout = layout_of(make_case("cpu", torch.float16))
    for bad in (0, -1, 1.5, True):
        with pytest.raises(UnsupportedLayoutError):
            layout.chunk_bytes(bad)  # type: ignore[arg-type]


def test_all_layout_names_build(make_case) -> None:
    """Every layout of the test matrix builds for every width-relevant dtype."""
    for name in LAYOUT_NAMES:
        for dtype in (torch.float32, torch.float16):
            assert layout_of(make_case(name, dtype)).num_blocks == 12
