"""One engine step's stores: slots asked for as the step starts, blocks read before it ends.

A store's reads of the engine's KV cache belong to the step that scheduled it. vLLM may hand
a block to another request, zero it or copy into it as soon as the next step begins (Model
Runner V2 does so in `update_requests`, before any connector hook runs; a sliding window's
blocks and a preempted or finished request's go back to vLLM's pool at once). So:

1. `StepStores.reserve` (when vLLM binds the step's metadata, before the forward pass) asks
   the server for the slots of every store of the step, in one message. A local server's reply
   is a round trip away (~0.1 ms) and lands during the forward pass.
2. `StepStores.gather` (in `wait_for_save`, or vLLM's `finalize_step`, on the engine's thread)
   copies each store's blocks into its slots. On a CPU the copy has ended when it returns; on
   CUDA it runs on the copier's side stream after the forward pass, and the compute stream
   waits for it (no host wait): any later write of those blocks is ordered after the read.
3. `StepStores.commit` (the worker's copy thread, after the step) waits for the copies that
   may still run on the device and commits them: only then are the chunks visible to lookups.

A reply that has not landed when the step ends (`RESERVE_WAIT_S`) skips its store, and its
slots are given back when it lands: the step never waits on the server for longer. Such a store,
and one whose reservation grew too old, is named in `skipped`: the worker reports it to the
scheduler, which plans it again while the request still holds its blocks (`STORE_AGAIN_MAX`
times at most).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from kvdepot.transport import CacheClient
    from kvdepot.vllm_connector._meta import StoreOp

log = logging.getLogger("vllm.kvdepot.worker")

#: How long the end of a step waits at most for its slots (seconds, from the first store's
#: wait): the reply was asked for before the forward pass, so it is normally in already; a
#: server slower than this costs the step its stores, never more time.
RESERVE_WAIT_S = 0.01
#: A store copies into its reserved slots only within this fraction of the server's reservation
#: TTL since it asked for them: the commit then has the rest of the TTL, and the quarantine's one
#: more TTL, to land before the slots can go to another client.
LATE_COPY_FRACTION = 0.5


class StepStores:
    """The stores of one engine step, from their reservation to their commit."""

    def __init__(
        self, client: CacheClient, ops: Sequence[StoreOp], futures: Sequence[Future[Any]], server_id: str
    ) -> None:
        self.client = client
        self.server_id = server_id
        self.asked = time.monotonic()  # the reservations expire no sooner than their TTL from now
        self.pending = list(zip(ops, futures, strict=True))
        # Stores skipped because the server was slow, not down: they may be planned again.
        self.skipped: list[StoreOp] = []
        # Gathered stores, with the copies' handles: the copy thread commits them.
        self.gathered: list[tuple[StoreOp, Any, list[Any]]] = []

    @classmethod
    def reserve(
        cls, client: CacheClient, ops: Sequence[StoreOp], *, rank: int, chunk_bytes: int, server_id: str
    ) -> StepStores:
        """Ask the server for every store's slots, in one message (the replies land later)."""
        with client.batch() as batch:
            futures = [batch.reserve(op.salt, op.keys[rank], chunk_bytes, server_id=server_id) for op in ops]
        return cls(client, ops, futures, server_id)

    def gather(
        self,
        copy: Callable[[StoreOp, Any], list[Any]],
        *,
        reservation_ttl: float,
        count: Callable[[str, int], None],
        server_failed: Callable[[BaseException], None],
    ) -> None:
        """Copy each reserved store's blocks into its slots, on the engine's thread (`copy` makes
        the copies and returns their handles). A store whose slots have not come is skipped."""
        deadline = time.monotonic() + RESERVE_WAIT_S
        pending, self.pending = self.pending, []
        for op, future in pending:
            try:
                reply = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                count("store_skipped", 1)
                log.warning(
                    "kvdepot store of %s skipped: the server had not reserved its slots by the step's end", op.req_id
                )
                self._abort_on_arrival(future)
                self.skipped.append(op)
                continue
            except Exception as exc:
                server_failed(exc)
                count("store_skipped", 1)
                log.warning("kvdepot store of %s skipped, the server did not reserve: %s", op.req_id, exc)
                continue
            if not reply.slots:
                continue  # the server holds every chunk already
            age = time.monotonic() - self.asked
            if reservation_ttl and age > reservation_ttl * LATE_COPY_FRACTION:
                # A process paused, or the engine thread stalled: the slots may soon go to another client.
                count("store_late", 1)
                log.warning(
                    "kvdepot store of %s dropped: its reservation is %.1f s old, the server keeps it %.1f s",
                    op.req_id, age, reservation_ttl,
                )  # fmt: skip
                self._abort(reply)
                self.skipped.append(op)
                continue
            try:
                handles = copy(op, reply)
            except Exception as exc:
                log.warning("kvdepot gather for %s failed, aborting its reservation: %s", op.req_id, exc)
                self._abort(reply)
                continue
            self.gathered.append((op, reply, handles))

    def abort(self) -> None:
        """Give back every slot of this step not yet copied into (the step's stores will not run)."""
        pending, self.pending = self.pending, []
        for _op, future in pending:
            self._abort_on_arrival(future)

    def commit(
        self,
        *,
        pin_s: float,
        count: Callable[[str, int], None],
        chunk_bytes: int,
        server_failed: Callable[[BaseException], None],
        before_commit: Callable[[], None] | None = None,
    ) -> None:
        """Commit each gathered store once its copy is done (the copy thread: a CUDA copy may
        still run on its stream); returns once the server answered, so a later lookup sees them.
        ``before_commit``: a test's hook, run before each commit (`testing.wait_for_gate`)."""
        answers = []
        for op, reply, handles in self.gathered:
            try:
                for handle in handles:
                    handle.wait()
            except Exception as exc:
                log.warning("kvdepot gather for %s failed, aborting its reservation: %s", op.req_id, exc)
                answers.append(self._abort(reply))
                continue
            if before_commit is not None:
                before_commit()
            count("stored_chunks", len(reply.slots))
            count("stored_bytes", len(reply.slots) * chunk_bytes)
            answers.append(self.client.commit(reply.reservation_id, server_id=self.server_id, pin_s=pin_s))
        self.gathered = []
        for answer in answers:
            if answer is None:
                continue
            try:
                answer.result()
            except Exception as exc:
                server_failed(exc)
                log.warning("kvdepot commit or abort failed; the chunks stay invisible and expire: %s", exc)

    def _abort(self, reply: Any) -> Future[Any] | None:
        try:
            return self.client.abort(reply.reservation_id, server_id=self.server_id)
        except Exception as exc:  # the reservation expires on the server by itself
            log.warning("kvdepot could not give back a reservation (it will expire): %s", exc)
            return None

    def _abort_on_arrival(self, future: Future[Any]) -> None:
        def abort(done: Future[Any]) -> None:  # runs on the transport's settler thread
            if done.cancelled() or done.exception() is not None:
                return
            reply = done.result()
            if reply.slots:
                self._abort(reply)

        future.add_done_callback(abort)
