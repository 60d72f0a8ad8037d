"""kvdepot.core: pure block/token accounting shared by the server, the connector and routers.

Nothing here does I/O, reads a clock, logs, or imports anything heavier than attrs.
"""

from kvdepot.core._errors import (
    InvalidArgumentError,
    InvalidTransitionError,
    KVDepotError,
    ParallelConfigError,
    UnknownRequestError,
)
from kvdepot.core._keys import DEFAULT_CHUNK_SIZE, KEY_SIZE, KeyChain, Namespace, chunk_keys, pack_tokens
from kvdepot.core._labels import LABEL_KEY_BYTES, SaltLabeler, salt_label
from kvdepot.core._parallel import ParallelStrategy
from kvdepot.core._planner import Planner, RequestTracker
from kvdepot.core._plans import RetrievePlan, StorePlan
from kvdepot.core._recovery import LoadedRequest, Recovery, recover_load_failures
from kvdepot.core._slot_index import INDEX_ENTRY_BYTES, SlotIndexWriter, find_in_index, index_entries
from kvdepot.core._slots import (
    SLOT_GENERATION_OFFSET,
    SLOT_HEADER_BYTES,
    pack_slot_header,
    slot_digest,
    slot_header_holds,
    unpack_slot_header,
)
from kvdepot.core._state import TRANSITIONS, Event, RequestState
from kvdepot.core._version import __version__

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "INDEX_ENTRY_BYTES",
    "KEY_SIZE",
    "LABEL_KEY_BYTES",
    "SLOT_GENERATION_OFFSET",
    "SLOT_HEADER_BYTES",
    "TRANSITIONS",
    "Event",
    "InvalidArgumentError",
    "InvalidTransitionError",
    "KVDepotError",
    "KeyChain",
    "LoadedRequest",
    "Namespace",
    "ParallelConfigError",
    "ParallelStrategy",
    "Planner",
    "Recovery",
    "RequestState",
    "RequestTracker",
    "RetrievePlan",
    "SaltLabeler",
    "SlotIndexWriter",
    "StorePlan",
    "UnknownRequestError",
    "__version__",
    "chunk_keys",
    "find_in_index",
    "index_entries",
    "pack_slot_header",
    "pack_tokens",
    "recover_load_failures",
    "salt_label",
    "slot_digest",
    "slot_header_holds",
    "unpack_slot_header",
]
