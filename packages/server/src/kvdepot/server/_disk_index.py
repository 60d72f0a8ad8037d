"""The disk tier's index of its files: least-recently-used order, bytes per salt, capacity.

Pure bookkeeping: `DiskTier` (`_disk_tier.py`) holds its lock around every call, and does the
file operations. An eviction forgets a file here and hands its digest to ``evict``, which
deletes it (still under the lock, as before the index was its own class).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

from kvdepot.server._disk_files import ObjectFile
from kvdepot.server._tiers import ChunkRef


class DiskIndex:
    """The files of a disk tier of ``capacity`` bytes (headers included). ``evict``: deletes the
    file of a digest the index just forgot to make room."""

    def __init__(self, evict: Callable[[bytes], None]) -> None:
        self.capacity = 0  # set by the tier once it knows its files
        self._evict = evict
        self.files: OrderedDict[bytes, ObjectFile] = OrderedDict()  # least recently used first
        self.used = 0  # bytes of the files in the index
        self._salts: dict[bytes, OrderedDict[bytes, None]] = {}  # per salt tag: its digests, LRU first
        self._salt_used: dict[bytes, int] = {}  # per salt tag: bytes of its files, and of one being written
        self.reserved = 0  # bytes of files being written
        # Files of a format this build does not read (digest -> bytes): left alone, but counted
        # against the capacity.
        self.unknown: dict[bytes, int] = {}
        self.unknown_bytes = 0

    def load(self, files: Iterable[tuple[float, bytes, ObjectFile]], unknown: dict[bytes, int]) -> None:
        """Index the files a start found (each with its last use), and those of unknown formats."""
        for _, digest, entry in sorted(files, key=lambda item: item[0]):  # oldest first
            self.add(digest, entry)
        self.unknown = unknown
        self.unknown_bytes = sum(unknown.values())

    def occupied(self) -> int:
        """Bytes held against the capacity: files, files being written, and files of a format
        this build does not read."""
        return self.used + self.reserved + self.unknown_bytes

    def salt_bytes(self, tag: bytes) -> int:
        return self._salt_used.get(tag, 0)

    def lengths(self, refs: Sequence[ChunkRef]) -> list[int | None]:
        """The payload length of each chunk's file, None where there is no file of its fingerprint."""
        found = [self.files.get(ref.digest) for ref in refs]
        return [
            e.length if e is not None and e.fingerprint == ref.fingerprint else None
            for e, ref in zip(found, refs, strict=True)
        ]

    def digests_of(self, tag: bytes | None) -> list[bytes]:
        """The digests of a salt's files (None: of every file), least recently used first."""
        return list(self.files if tag is None else self._salts.get(tag, ()))

    def add(self, digest: bytes, entry: ObjectFile) -> None:
        """Index a file, most recently used."""
        self.files[digest] = entry
        self.used += entry.size
        self._salts.setdefault(entry.tag, OrderedDict())[digest] = None
        self._salt_used[entry.tag] = self._salt_used.get(entry.tag, 0) + entry.size

    def forget(self, digest: bytes) -> ObjectFile | None:
        """Drop a file from the index; its entry, or None."""
        entry = self.files.pop(digest, None)
        if entry is not None:
            self.used -= entry.size
            own = self._salts[entry.tag]
            del own[digest]
            if not own:
                del self._salts[entry.tag]
            self.charge(entry.tag, -entry.size)
        return entry

    def forget_if(self, digest: bytes, entry: ObjectFile) -> None:
        """Drop a file found gone from the index, unless another was written under its name since."""
        if self.files.get(digest) is entry:
            self.forget(digest)

    def replace(self, digest: bytes, entry: ObjectFile) -> None:
        """Index a file just renamed into place: whatever was under its name before (written
        meanwhile by another thread, or of another format) it replaced."""
        self.forget(digest)
        self.unknown_bytes -= self.unknown.pop(digest, 0)
        self.add(digest, entry)

    def set_aside(self, digest: bytes, entry: ObjectFile) -> None:
        """A file found of a format this build does not read: out of the LRU order (never evicted),
        still counted against the capacity. Nothing if it is no longer the file indexed."""
        if self.files.get(digest) is entry:
            self.forget(digest)
            self.unknown[digest] = entry.size
            self.unknown_bytes += entry.size

    def forget_unknown(self) -> list[bytes]:
        """Forget every file of a format this build does not read; their digests."""
        digests = list(self.unknown)
        self.unknown.clear()
        self.unknown_bytes = 0
        return digests

    def charge(self, tag: bytes, delta: int) -> None:
        """Count ``delta`` bytes more (or fewer) against the salt's quota."""
        used = self._salt_used.get(tag, 0) + delta
        if used:
            self._salt_used[tag] = used
        else:
            self._salt_used.pop(tag, None)

    def touch(self, digest: bytes, entry: ObjectFile) -> None:
        """Mark a file most recently used."""
        self.files.move_to_end(digest)
        self._salts[entry.tag].move_to_end(digest)

    def use(self, digest: bytes, fingerprint: bytes, length: int) -> ObjectFile | None:
        """The file that holds this very chunk already (marked most recently used), or None."""
        kept = self.files.get(digest)
        if kept is None or kept.length != length or kept.fingerprint != fingerprint:
            return None
        self.touch(digest, kept)
        return kept

    def reserve(self, digest: bytes, tag: bytes, size: int, quota: int | None) -> bool:
        """Room for a new file of ``size`` bytes under ``digest``, of the salt ``tag`` (whose
        quota is ``quota``), counted as being written (and toward the salt's quota) until
        `unreserve`; False when there is none."""
        if digest in self.files:  # a stale object under this name: it goes, whatever happens next
            self.evict(digest)
        # The salt's quota first, from its own files; then the capacity, from everyone's LRU.
        if quota is not None and not self.make_salt_room(tag, size, quota):
            return False
        self.make_room(size)
        if self.occupied() + size > self.capacity:  # the rest is being written now, or unknown
            return False
        self.reserved += size
        self.charge(tag, size)
        return True

    def unreserve(self, tag: bytes, size: int) -> None:
        """A file `reserve` made room for is written (its entry counts it now), or failed."""
        self.reserved -= size
        self.charge(tag, -size)

    def evict(self, digest: bytes) -> None:
        """Forget a file and delete it."""
        self.forget(digest)
        self._evict(digest)

    def make_room(self, size: int) -> int:
        """Evict least recently used files until ``size`` more bytes fit; how many."""
        evicted = 0
        while self.files and self.occupied() + size > self.capacity:
            self.evict(next(iter(self.files)))
            evicted += 1
        return evicted

    def make_salt_room(self, tag: bytes, size: int, quota: int) -> bool:
        """Evict the salt's own least recently used files until ``size`` more bytes fit in its
        quota; False when they cannot (the chunk alone is larger)."""
        if size > quota:
            return False
        own = self._salts.get(tag)
        while own and self._salt_used.get(tag, 0) + size > quota:
            self.evict(next(iter(own)))
        return self._salt_used.get(tag, 0) + size <= quota

    def free(self, size: int) -> int:
        """Evict least recently used files until ``size`` bytes went (a full file system); the bytes freed."""
        freed = 0
        while self.files and freed < size:
            digest = next(iter(self.files))
            freed += self.files[digest].size
            self.evict(digest)
        return freed
