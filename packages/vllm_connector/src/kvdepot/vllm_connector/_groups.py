"""vLLM's KV-cache groups as kvdepot serves them, and the ones it refuses.

A model whose layers attend differently (sliding-window and full attention, as Gemma 2 and 3,
gpt-oss or Mistral-style windows) gets one KV-cache group per kind of layer from vLLM's hybrid
KV-cache manager, each with its own block table over one shared block pool. kvdepot stores a
chunk as the blocks of every group together (one pool slot: group after group, each group's
layers in its own order), so a hit restores what every group needs.

What kvdepot does with a group whose old blocks vLLM drops (a sliding window, chunked local
attention): a chunk is stored whole, every block of every group, and only while all of them
still hold their tokens; vLLM gives a block that left the window back to its pool and puts its
null block in the request's table, and a chunk with such a block is not stored by that
request. A load writes only the blocks vLLM allocated for it: those outside the window are
vLLM's null block and are skipped, so a long hit moves only the window's blocks of those layers.

Groups whose blocks are not positional token KV (Mamba and other linear-attention state,
cross-attention, encoder-only) are refused at start, naming the layer type; vLLM needs its
hybrid manager for those models anyway, so declaring hybrid support never stops a fallback
vLLM could have made on its own.

vLLM 0.33 marks the groups that take part in KV transfer (`KVCacheConfig.transfer_group_ids`)
and, of those, the ones an offloader may store by hash (`prefix_cacheable_group_ids`). A group
outside the transfer (an ephemeral replica vLLM rebuilds from its source group after a load) is
left to vLLM: kvdepot neither stores nor loads it. A transferable group that is not
prefix-cacheable (a ring buffer, a window replayed from its start) is refused at start like any
other type kvdepot does not serve: a hit could not restore it, and the output would be wrong.
A `CacheGroup` keeps vLLM's index of its group.
"""

from __future__ import annotations

from typing import Any

import attrs

from kvdepot.core import KVDepotError

#: vLLM spec classes kvdepot serves, by exact class name, and the kind it calls them.
SUPPORTED_SPECS = {
    "FullAttentionSpec": "full",
    "MLAAttentionSpec": "mla",
    "SlidingWindowSpec": "sliding_window",
    "ChunkedLocalAttentionSpec": "chunked_local",
}
#: Kinds whose blocks vLLM keeps for the whole request (never nulled while it runs).
STABLE_KINDS = frozenset({"full", "mla"})
#: The id of vLLM's null block (`BlockPool.null_block`): a placeholder that holds nothing.
NULL_BLOCK_ID = 0


class ConnectorConfigError(KVDepotError, ValueError):
    """The engine's configuration cannot work with kvdepot; the message says what to change."""


@attrs.frozen
class CacheGroup:
    """One of vLLM's KV-cache groups: its layers and how it attends."""

    layer_names: tuple[str, ...]
    kind: str = "full"
    #: Tokens of the window (sliding_window) or of the local chunk (chunked_local); 0 otherwise.
    window: int = 0
    #: vLLM's index of the group (its block ids come in this place of vLLM's per-group tuples).
    index: int = 0

    @property
    def stable(self) -> bool:
        """True when vLLM never drops the group's blocks while a request runs."""
        return self.kind in STABLE_KINDS

    def describe(self) -> str:
        """Short text for layout names and fingerprints, e.g. ``sliding_window256x2``."""
        return f"{self.kind}{self.window or ''}x{len(self.layer_names)}"


def _inner_specs(spec: Any) -> list[Any]:
    """The per-layer specs of a group (vLLM merges same-type layers of other shapes into one spec)."""
    inner = getattr(spec, "kv_cache_specs", None)
    return list(inner.values()) if isinstance(inner, dict) and inner else [spec]


def cache_groups(kv_cache_config: Any) -> tuple[CacheGroup, ...]:
    """kvdepot's view of vLLM's KV-cache groups; `ConnectorConfigError` names a layer type it cannot serve.

    ``kv_cache_config`` is vLLM's `KVCacheConfig` (None: one group of every layer, as before
    vLLM passed it to connectors).
    """
    if kv_cache_config is None:
        return (CacheGroup(()),)
    transferred = getattr(kv_cache_config, "transfer_group_ids", None)  # vLLM 0.33 on
    cacheable = getattr(kv_cache_config, "prefix_cacheable_group_ids", None)
    groups = []
    for index, group in enumerate(kv_cache_config.kv_cache_groups):
        if transferred is not None and index not in transferred:
            continue  # vLLM's own replica, rebuilt from its source group after a load
        if cacheable is not None and index not in cacheable:
            raise _refused(type(group.kv_cache_spec).__name__, index, list(group.layer_names), "not prefix-cacheable")
        kinds, windows = set(), set()
        for spec in _inner_specs(group.kv_cache_spec):
            name = type(spec).__name__
            kind = SUPPORTED_SPECS.get(name)
            if kind is None:
                raise _refused(name, index, list(group.layer_names))
            kinds.add(kind)
            windows.add(int(getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", 0) or 0))
        if len(kinds) != 1 or len(windows) != 1:
            raise ConnectorConfigError(
                f"kvdepot cannot serve KV-cache group {index}: its layers mix {sorted(kinds)} with windows "
                f"{sorted(windows)}. Run this model without the kvdepot connector.",
                group=index,
            )
        groups.append(CacheGroup(tuple(group.layer_names), kinds.pop(), windows.pop(), index))
    if not groups:
        raise ConnectorConfigError(
            "the model has no KV-cache group that takes part in vLLM's KV transfer; "
            "run it without the kvdepot connector"
        )
    return tuple(groups)


def _refused(spec_name: str, index: int, layers: list[str], why: str = "") -> ConnectorConfigError:
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    if why:
        what = f"vLLM marks the group {why}, so a hit could not restore it"
        fix = "Run this model without the kvdepot connector."
    elif "Mamba" in spec_name or "Linear" in spec_name:
        what = "state-space or linear-attention state, which is not positional per-token KV"
        fix = "Run this model without the kvdepot connector (vLLM needs its hybrid KV-cache manager for it)."
    else:
        what = "a KV-cache layer type kvdepot does not store"
        fix = (
            "Run this model without the kvdepot connector, or start vLLM with --disable-hybrid-kv-cache-manager "
            "if vLLM can serve these layers as full attention."
        )
    return ConnectorConfigError(
        f"kvdepot cannot serve layers of type {spec_name} (KV-cache group {index}: {shown}): {what}. {fix} "
        f"kvdepot serves {', '.join(SUPPORTED_SPECS)}.",
        layer_type=spec_name,
        group=index,
    )


def unserved_layers(kv_cache_config: Any) -> frozenset[str]:
    """The layers of the groups kvdepot leaves to vLLM (outside the KV transfer)."""
    served = getattr(kv_cache_config, "transfer_group_ids", None)
    if kv_cache_config is None or served is None:
        return frozenset()
    groups = kv_cache_config.kv_cache_groups
    return frozenset(name for i, group in enumerate(groups) if i not in served for name in group.layer_names)


def ours(groups: tuple[CacheGroup, ...], per_group: Any) -> tuple[list[int], ...]:
    """kvdepot's groups' entries of one of vLLM's per-group tuples (block ids, one list per group)."""
    if not per_group:
        return ()
    return tuple(per_group[group.index] for group in groups)


def layout_part(groups: tuple[CacheGroup, ...]) -> str | None:
    """What the groups add to the layout name (part of every key); None for one full-attention group."""
    if len(groups) == 1 and groups[0].stable:
        return None
    return "groups=" + "+".join(group.describe() for group in groups)
