"""The KV-events publisher's replay buffer: the last batches, bounded in count and in bytes,
found by sequence number in O(log n) (a peer's request never walks the buffer)."""

from __future__ import annotations

import bisect


class ReplayBuffer:
    """Batches ``(seq, payload)`` in increasing `seq` (numbers may skip); the oldest go first
    once there are more than `max_batches` or their payloads exceed `max_bytes` (publisher thread)."""

    def __init__(self, max_batches: int, max_bytes: int) -> None:
        self.max_batches = max_batches
        self.max_bytes = max_bytes
        self.bytes = 0  # payload bytes held
        self._seqs: list[int] = []
        self._payloads: list[bytes] = []
        self._head = 0  # index of the oldest batch kept; the lists are compacted now and then

    def __len__(self) -> int:
        return len(self._seqs) - self._head

    def append(self, seq: int, payload: bytes) -> None:
        assert not len(self) or seq > self._seqs[-1]
        self._seqs.append(seq)
        self._payloads.append(payload)
        self.bytes += len(payload)
        while len(self) > self.max_batches or (self.bytes > self.max_bytes and len(self) > 1):
            self.bytes -= len(self._payloads[self._head])
            self._payloads[self._head] = b""
            self._head += 1
        if self._head > len(self._seqs) // 2:  # compact: amortised O(1) per batch
            del self._seqs[: self._head]
            del self._payloads[: self._head]
            self._head = 0

    def page(self, start: int, max_bytes: int, max_batches: int) -> list[tuple[int, bytes]]:
        """The kept batches from number `start` on, while their payloads add up to at most
        `max_bytes` and they are at most `max_batches`; the first always, so a reader moves on."""
        i = bisect.bisect_left(self._seqs, start, lo=self._head)
        out: list[tuple[int, bytes]] = []
        size = 0
        for j in range(i, min(i + max_batches, len(self._seqs))):
            size += len(self._payloads[j])
            if out and size > max_bytes:
                break
            out.append((self._seqs[j], self._payloads[j]))
        return out
