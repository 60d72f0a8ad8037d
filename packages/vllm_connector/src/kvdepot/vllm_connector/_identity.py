"""What the KV bytes depend on besides token ids: the model's and the LoRA adapter's weights,
and a request's multimodal inputs (`request_marks`).

A model in a local directory is named by a fingerprint of its files, not by its path: the
config and tokenizer files whole, and each weight file by its name, its size and SHA-256 of
samples of its bytes (the first, middle and last MiB). So

- a directory whose weights are replaced (a `current` symlink moved, a fine-tune written over
  the old files) gets new keys: nothing stored from the old weights is a hit;
- two engines serving the same files from different paths share chunks.

Hashing whole multi-GB files at every engine start would cost seconds; a fine-tune changes
every tensor, so the samples change with it. A model named on a hub is named by its id and
revision. The fingerprint is computed once per path and state of its files (names, sizes,
modification times, inodes): an adapter written over in place, as RL loops reload theirs,
gets a new one at its next request, while an unchanged directory costs a listing and a stat
per file.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

#: Bytes hashed at each of the three places sampled in a weight file.
SAMPLE_BYTES = 1 << 20
#: Files hashed whole: small, and they change what the weights mean.
_WHOLE_FILES = frozenset(
    {
        "config.json",
        "generation_config.json",
        "adapter_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    }
)
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz")


def _sample_digest(path: Path, size: int) -> bytes:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for at in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
            f.seek(at)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.digest()


def directory_fingerprint(directory: str) -> str:
    """A hex digest of the weights and config in ``directory`` (see the module's docstring)."""
    files = sorted(p for p in Path(directory).rglob("*") if p.is_file())
    state = tuple((str(p), st.st_size, st.st_mtime_ns, st.st_ino) for p in files for st in [p.stat()])
    return _fingerprint(directory, state)


@functools.lru_cache(maxsize=64)
def _fingerprint(directory: str, state: tuple[tuple[str, int, int, int], ...]) -> str:
    """The digest of ``directory``'s files, cached while they keep ``state`` (names, sizes, times, inodes)."""
    digest = hashlib.sha256(b"kvdepot/weights/v1")
    root = Path(directory)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if path.name in _WHOLE_FILES or name.endswith(".index.json"):
            digest.update(b"whole\0" + name.encode() + b"\0" + hashlib.sha256(path.read_bytes()).digest())
        elif path.name.endswith(_WEIGHT_SUFFIXES):
            size = path.stat().st_size
            digest.update(b"weights\0" + name.encode() + b"\0" + str(size).encode() + _sample_digest(path, size))
    return digest.hexdigest()


def model_identity(vllm_config: VllmConfig) -> str:
    """The model as the KV bytes see it: its weights, quantization and config overrides."""
    model = vllm_config.model_config
    name = str(model.model)
    if os.path.isdir(name):
        weights = f"dir:{directory_fingerprint(os.path.realpath(name))}"
    else:
        weights = f"hub:{name}@{getattr(model, 'revision', None) or ''}"
    parts = [
        weights,
        str(getattr(model, "quantization", None) or ""),
        repr(getattr(model, "hf_overrides", None) or ""),
    ]
    return "|".join(parts)


def lora_identity(request: Any) -> str | None:
    """The LoRA adapter by name and the fingerprint of its files (its path and id when not a directory)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    path = str(getattr(lora, "lora_path", "") or "")
    if path and os.path.isdir(path):
        return f"{lora.lora_name}|dir:{directory_fingerprint(os.path.realpath(path))}"
    return f"{lora.lora_name}|{getattr(lora, 'lora_int_id', '')}|{path}"


def request_marks(request: Request) -> tuple[tuple[int, bytes], ...] | None:
    """(position, digest) of what the KV depends on besides token ids; None if the request
    cannot be cached.

    A multimodal input is identified by vLLM's content hash and its placeholder's position
    and length, and keys only the chunks from its position on (`kvdepot.core.KeyChain`), so
    requests that share a text prefix before it share those chunks, as in vLLM's own prefix
    cache. Prompt embeddings have no token ids at all (vLLM reports zeros), so such requests
    are not cached.
    """
    if getattr(request, "prompt_embeds", None) is not None:
        return None
    marks = []
    for feature in getattr(request, "mm_features", None) or ():
        pos = feature.mm_position
        text = f"{feature.identifier}|{pos.offset}|{pos.length}"
        marks.append((pos.offset, hashlib.sha256(text.encode()).digest()))
    return tuple(marks)
