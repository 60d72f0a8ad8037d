"""The KV-event publisher's figures in /metrics (``kvdepot_kv_events_*``), read from the publisher
(`KVEventPublisher.figures` and its counters) at each scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kvdepot.server._kv_publisher import KVEventPublisher


class KVEventsCollector:
    """The publisher's figures in /metrics (duck-typed prometheus-client collector)."""

    def __init__(self, publisher: KVEventPublisher) -> None:
        self._publisher = publisher
        #: the tcp listeners' figures: the server's registry shows them as ``kvdepot_listener_*``
        self.listeners = publisher.listener_figures()

    def collect(self) -> Iterator[Any]:
        p = self._publisher
        figures = p.figures()
        for name, value, doc in (
            ("batches", p.seq, "KV-event batches numbered (published, or skipped for dropped events)."),
            ("sent", p.published_events, "KV events published."),
            ("dropped", p.dropped, "KV events dropped because the publisher fell behind (subscribers see a gap)."),
            ("replay_pages", p.replay_pages, "Replay requests answered (one page each)."),
        ):
            yield CounterMetricFamily(f"kvdepot_kv_events_{name}", doc, value=value)
        refused = CounterMetricFamily(
            "kvdepot_kv_events_replay_refused",
            "Replay requests not answered: bad_request (not one 8-byte number), unread (the peer has not "
            "read its last page).",
            labels=["reason"],
        )
        for reason, count in p.replay_refused.items():
            refused.add_metric([reason], count)
        yield refused
        yield GaugeMetricFamily(
            "kvdepot_kv_events_replay_buffer_bytes",
            "Payload bytes of the batches kept for replay (0 without a replay endpoint).",
            value=figures["kv_events_replay_buffer_bytes"],
        )
        yield CounterMetricFamily(
            "kvdepot_kv_events_subscriptions_refused",
            "Subscriptions to the KV-events PUB socket not applied: not a prefix of the topic, so they could "
            "match nothing (and any other message a subscriber sent).",
            value=p.subscriptions_refused,
        )
        yield CounterMetricFamily(
            "kvdepot_kv_events_subscribers_cut",
            "tcp peers of the KV-events PUB port disconnected for sending more than --kv-events-subscriber-send-bytes "
            "(checked when a subscription is refused).",
            value=figures["kv_events_subscribers_cut"],
        )
        limits = GaugeMetricFamily(
            "kvdepot_kv_events_limit", "The KV-events publisher's bounds (flags of kvdepot serve).", labels=["limit"]
        )
        for name, value in p.limits.items():
            limits.add_metric([name], value)
        yield limits
