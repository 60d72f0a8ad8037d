"""`kvdepot proxy`: an OpenAI endpoint that prefills on one vLLM and decodes on another.

It follows vLLM's proxy contract for prefill/decode disaggregation. Each completion or chat
completion goes first to a prefill server (vLLM with the kvdepot connector and ``kv_role:
kv_producer``) with ``max_tokens=1``, no streaming, and ``kv_transfer_params:
{"do_remote_decode": true}``. The ``kv_transfer_params`` of its answer then go with the
client's own request to a decode server (``kv_role: kv_consumer``), whose answer, streamed or
not, is passed back as it comes. The KV itself never passes through the proxy: the decode
engine finds the prefill engine's chunks in kvdepot (`_handoff.py`).

Where the prefill server fails or does not answer, the request still goes to the decode
server, without parameters: it computes the whole prompt (slower, never wrong), and the
proxy logs why. Several ``--prefill`` and ``--decode`` servers are used in turn. The proxy
needs aiohttp: vLLM's OpenAI server depends on it, and the ``proxy`` extra installs it.

Any local user may call it, so it holds only what its bounds allow (`_proxy_guard.py`):
client connections, each with deadlines for its request's head and its idle time
(`_proxy_listener.py`), requests in flight, and request bodies, which it rewrites without
decoding them (`_proxy_json.py`). Other ``GET /v1/...`` paths pass to a decode server only when normalised.
An answer a server cuts midway reaches the client cut (an SSE error event, then the connection
closed without the answer's end), never as a complete one. `/metrics` counts all of this.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import resource
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import msgspec
import structlog

from kvdepot.core import KVDepotError
from kvdepot.server import SimpleCommand, configure_logging, format_size, parse_size
from kvdepot.vllm_connector._proxy_guard import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEPALIVE_TIMEOUT_S,
    DEFAULT_MAX_BODY,
    DEFAULT_MAX_BODY_TOTAL,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUESTS,
    RETRY_AFTER_S,
    Admission,
    BodyHold,
    BodyTimeoutError,
    BodyTooLargeError,
    ProxyLimits,
    ProxyMetrics,
    ProxyRefusal,
    passthrough_target,
)
from kvdepot.vllm_connector._proxy_json import (
    Fields,
    decode_request,
    parse_request,
    prefill_request,
    transfer_params,
)

if TYPE_CHECKING:
    from aiohttp import ClientResponse, ClientSession, web

log = structlog.get_logger("kvdepot.proxy")

#: Routes passed through the prefill step; other paths of the OpenAI API go to a decode server.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Request headers passed on to the vLLM servers (an API key, a request id).
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
#: What a client reads last in a streamed answer that a server cut midway (vLLM's error shape).
CUT_EVENT = (
    b'data: {"error": {"message": "the vLLM server cut its answer midway", "type": "UpstreamCutError", "code": 502}}'
    b"\n\n"
)


class AnswerTooLargeError(KVDepotError):
    """A prefill server's answer larger than the proxy reads (`--max-body`)."""


Handler = Callable[["web.Request"], Awaitable["web.StreamResponse"]]


def _forwarded(request: web.Request) -> dict[str, str]:
    return {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}


class Proxy:
    """The proxy's state: the servers to use in turn, its bounds and figures, and one HTTP client session."""

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        timeout: float,
        limits: ProxyLimits,
        body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self._prefill: Iterator[str] = itertools.cycle([url.rstrip("/") for url in prefill])
        self._decode: Iterator[str] = itertools.cycle([url.rstrip("/") for url in decode])
        self.timeout = timeout
        self.body_timeout = body_timeout
        self.limits = limits
        self.metrics = ProxyMetrics(limits)
        self.admission = Admission(limits, self.metrics)
        self.session: ClientSession | None = None
        self.counts = {"requests": 0, "prefill_failures": 0}

    async def start(self, app: web.Application) -> None:
        import aiohttp

        # A request holds one connection at a time (prefill, then decode), so --max-requests bounds
        # them; a silent server fails a request after `timeout` seconds without a byte, however
        # long a streamed answer runs.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=self.limits.max_requests),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.timeout),
        )

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    def route(self, name: str, handler: Handler) -> Handler:
        """`handler` as one request in flight, with the proxy's refusals answered and counted."""
        from aiohttp import web

        async def handle(request: web.Request) -> web.StreamResponse:
            try:
                with self.admission.request(name):
                    return await handler(request)
            except ProxyRefusal as exc:
                self.metrics.refused.labels(exc.reason).inc()
                log.info("request_refused", reason=exc.reason, status=exc.status, why=exc.message)
                error = {"message": exc.message, "type": type(exc).__name__, "code": exc.status}
                headers = {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 503 else None
                return web.json_response({"error": error}, status=exc.status, headers=headers)

        return handle

    def completion(self, path: str) -> Handler:
        """The handler of one completion route: prefill, then decode with the prefill's ``kv_transfer_params``."""

        async def complete(request: web.Request) -> web.StreamResponse:
            self.counts["requests"] += 1
            headers = {**_forwarded(request), "Content-Type": "application/json"}
            hold = await self._receive(request)
            try:
                url = next(self._decode) + path
                # The decode body goes straight into _relay's frame, which drops it once it is sent.
                return await self._relay(
                    request, url, await self._decode_body(request, path, headers, hold), headers, hold
                )
            finally:
                hold.release()

        return complete

    async def _receive(self, request: web.Request) -> BodyHold:
        """Count the request's body as held before it is read; refuse it where it is too large or does not fit."""
        declared = request.content_length
        if declared is not None and declared > self.limits.max_body:
            raise BodyTooLargeError(
                f"the request body is {declared} bytes; the most is {self.limits.max_body} (--max-body)"
            )
        return self.admission.hold(self.limits.max_body if declared is None else declared)

    async def _decode_body(self, request: web.Request, path: str, headers: dict[str, str], hold: BodyHold) -> bytes:
        """Read the request, ask the prefill server, and return the decode server's request body."""
        try:
            body = await asyncio.wait_for(self._read_body(request), self.body_timeout)
        except TimeoutError:
            raise BodyTimeoutError(
                f"the request body took longer than {self.body_timeout} s (--body-timeout)"
            ) from None
        hold.resize(len(body))
        fields = parse_request(body)
        params = await self._prefill_params(path, fields, headers)
        return decode_request(fields, params)

    async def _read_body(self, request: web.Request) -> bytes:
        """The request body, read up to `--max-body` bytes (not kept by the request, as `request.read()` would)."""
        pieces: list[bytes] = []
        size = 0
        async for piece in request.content.iter_any():
            size += len(piece)
            if size > self.limits.max_body:
                raise BodyTooLargeError(f"the request body is larger than {self.limits.max_body} bytes (--max-body)")
            pieces.append(piece)
        return b"".join(pieces)

    async def _prefill_params(self, path: str, fields: Fields, headers: dict[str, str]) -> msgspec.Raw | None:
        """The prefill server's ``kv_transfer_params`` for the request; None where it failed (logged)."""
        import aiohttp

        assert self.session is not None
        url = next(self._prefill) + path
        try:
            async with self.session.post(url, data=prefill_request(fields), headers=headers) as reply:
                if reply.status == 200:
                    return transfer_params(await self._read_answer(reply))
                why = f"HTTP {reply.status}: {(await reply.content.read(300)).decode(errors='replace')}"
        except (aiohttp.ClientError, TimeoutError, KVDepotError) as exc:
            why = repr(exc)
        self.counts["prefill_failures"] += 1
        self.metrics.upstream_errors.labels("prefill").inc()
        log.warning("prefill_failed", url=url, error=why, then="the decode server computes the whole prompt")
        return None

    async def _read_answer(self, reply: ClientResponse) -> bytes:
        """A prefill server's answer, read up to `--max-body` bytes (AnswerTooLargeError past them)."""
        answer = bytearray()
        async for piece in reply.content.iter_any():
            answer += piece
            if len(answer) > self.limits.max_body:
                raise AnswerTooLargeError(f"the prefill answer is larger than {self.limits.max_body} bytes")
        return bytes(answer)

    async def _relay(
        self, request: web.Request, url: str, body: bytes, headers: dict[str, str], hold: BodyHold
    ) -> web.StreamResponse:
        """POST ``body`` to ``url`` and pass its answer back as it arrives."""
        import aiohttp
        from aiohttp import web

        assert self.session is not None
        try:
            reply_context = self.session.post(url, data=body, headers=headers)
            del body  # the request holds it until it is sent
            async with reply_context as reply:
                hold.release()
                return await self._pass_back(request, reply, url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.upstream_errors.labels("decode").inc()
            log.warning("decode_failed", url=url, error=repr(exc))
            raise web.HTTPBadGateway(text=f"the decode server {url} failed: {exc!r}") from None

    async def _pass_back(self, request: web.Request, reply: ClientResponse, url: str) -> web.StreamResponse:
        """Pass a decode server's answer back as it arrives; one it cuts midway reaches the client cut."""
        import aiohttp
        from aiohttp import web

        response = web.StreamResponse(status=reply.status)
        response.content_type = reply.content_type
        try:
            await response.prepare(request)
            pieces = reply.content.iter_any()
            while True:
                try:
                    piece = await pieces.__anext__()
                except StopAsyncIteration:
                    break
                except (aiohttp.ClientError, TimeoutError) as exc:
                    await self._cut(request, response, reply, url, exc)
                    return response
                await asyncio.wait_for(response.write(piece), self.timeout)
            await response.write_eof()
        except (ConnectionError, TimeoutError) as exc:
            self.metrics.clients_gone.inc()
            log.info("client_gone", url=url, error=repr(exc))
            if request.transport is not None:
                request.transport.close()
        return response

    async def _cut(
        self, request: web.Request, response: web.StreamResponse, reply: ClientResponse, url: str, exc: BaseException
    ) -> None:
        """Tell the client its answer was cut: an error event in a stream, then the connection closed before the end."""
        self.metrics.cut_streams.inc()
        self.metrics.upstream_errors.labels("decode").inc()
        log.warning(
            "answer_cut", url=url, error=repr(exc), then="the client's connection closes without the answer's end"
        )
        if reply.content_type == "text/event-stream":
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(response.write(CUT_EVENT), self.timeout)
        if request.transport is not None:
            request.transport.close()  # what was written still goes out; the final chunk never does

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other GET of the API (``/v1/models``, ...) from a decode server, for normalised paths only."""
        import aiohttp
        import yarl
        from aiohttp import web

        assert self.session is not None
        url = next(self._decode) + passthrough_target(request.raw_path)
        try:
            # encoded: the URL goes out exactly as checked, with no dot segments resolved on the way.
            async with self.session.get(yarl.URL(url, encoded=True), headers=_forwarded(request)) as reply:
                return await self._pass_back(request, reply, url)
        except (aiohttp.ClientError, TimeoutError) as exc:
            self.metrics.upstream_errors.labels("decode").inc()
            raise web.HTTPBadGateway(text=f"the decode server {url} failed: {exc!r}") from None

    async def health(self, request: web.Request) -> web.Response:
        """200 while the proxy runs (each vLLM server has its own /health)."""
        from aiohttp import web

        return web.json_response({"status": "ok", **self.counts})

    async def metrics_page(self, request: web.Request) -> web.Response:
        """The proxy's own figures, in Prometheus text."""
        from aiohttp import web

        response = web.Response(body=self.metrics.render())
        response.content_type = "text/plain"
        response.charset = "utf-8"
        return response


def make_app(
    prefill: Sequence[str],
    decode: Sequence[str],
    *,
    timeout: float = 600.0,
    limits: ProxyLimits | None = None,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
) -> web.Application:
    """The proxy as an aiohttp application (`kvdepot proxy` runs it with `_proxy_listener.serve`)."""
    from aiohttp import web

    from kvdepot.vllm_connector._proxy_listener import GUARD, ConnectionGuard

    limits = limits or ProxyLimits()
    proxy = Proxy(prefill, decode, timeout=timeout, limits=limits, body_timeout=body_timeout)
    guard = ConnectionGuard(limits, proxy.metrics)
    app = web.Application(client_max_size=limits.max_body, middlewares=[guard.middleware()])
    app[GUARD] = guard
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for path in COMPLETION_PATHS:
        app.router.add_post(path, proxy.route("completion", proxy.completion(path)))
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/metrics", proxy.metrics_page)
    app.router.add_get("/v1/{tail:.*}", proxy.route("passthrough", proxy.passthrough))
    return app


def _positive(parse: Callable[[str], int]) -> Callable[[str], int]:
    """An argparse type: `parse`, then more than 0 (argparse turns the error into exit code 2)."""

    def convert(text: str) -> int:
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"{text!r} must be more than 0")
        return value

    return convert


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--prefill", action="append", required=True, metavar="URL", help="a prefill vLLM server (repeatable)"
    )
    parser.add_argument(
        "--decode", action="append", required=True, metavar="URL", help="a decode vLLM server (repeatable)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a vLLM server may stay silent in a request, or a client leave a piece of its answer unread"
        " (default 600)",
    )
    parser.add_argument(
        "--max-body",
        type=_positive(parse_size),
        default=DEFAULT_MAX_BODY,
        metavar="SIZE",
        help=f"the largest request body; larger ones get a 413 (default {format_size(DEFAULT_MAX_BODY)})",
    )
    parser.add_argument(
        "--max-body-total",
        type=_positive(parse_size),
        default=DEFAULT_MAX_BODY_TOTAL,
        metavar="SIZE",
        help="memory for the request bodies held at once, each counted 3 times (as received and re-encoded for"
        f" both servers) until the decode server has it; past it a 503 (default {format_size(DEFAULT_MAX_BODY_TOTAL)})",
    )
    parser.add_argument(
        "--max-requests",
        type=_positive(int),
        default=DEFAULT_MAX_REQUESTS,
        metavar="N",
        help=f"requests in flight at once, streams included; past them a 503 (default {DEFAULT_MAX_REQUESTS})",
    )
    parser.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        metavar="SECONDS",
        help=f"seconds a client may take to send its request body; then a 408 (default {DEFAULT_BODY_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=_positive(int),
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="client connections open at once, at most what the file limit leaves beside --max-requests; past them"
        f" a new one gets a 503 unread and is closed (default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds from a connection's start, or from the first byte of its next request, to the end of that"
        f" request's head, however it is spread; then a 408 and closed (default {DEFAULT_HEADER_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--keepalive-timeout",
        type=float,
        default=DEFAULT_KEEPALIVE_TIMEOUT_S,
        metavar="SECONDS",
        help="seconds a connection may stay idle between requests; then closed"
        f" (default {DEFAULT_KEEPALIVE_TIMEOUT_S:g})",
    )


def run(args: argparse.Namespace) -> int:
    configure_logging("auto", "info", stream="stderr")
    try:
        from kvdepot.vllm_connector._proxy_listener import serve
    except ImportError as exc:  # aiohttp, which it imports
        log.error("aiohttp_missing", error=str(exc), fix="pip install 'kvdepot-vllm[proxy]'")
        return 1
    from kvdepot.server import raise_file_limit

    files = raise_file_limit()  # every client connection costs a descriptor; the cap is what it leaves
    if files.error is not None:
        log.warning("file_limit_kept", soft=files.soft, hard=files.hard, reason=files.error)
    try:
        limits = ProxyLimits(
            max_body=args.max_body,
            max_body_total=args.max_body_total,
            max_requests=args.max_requests,
            max_connections=args.max_connections,
            header_timeout=args.header_timeout,
            keepalive_timeout=args.keepalive_timeout,
        )
        if files.soft != resource.RLIM_INFINITY:
            limits = limits.within_file_limit(files.soft)
    except KVDepotError as exc:
        log.error("bad_limits", error=exc.message)
        return 2
    if limits.max_connections < args.max_connections:
        log.warning("connections_capped", asked=args.max_connections, cap=limits.max_connections, file_limit=files.soft)
    app = make_app(args.prefill, args.decode, timeout=args.timeout, limits=limits, body_timeout=args.body_timeout)
    try:
        asyncio.run(serve(app, args.host, args.port, prefill=args.prefill, decode=args.decode))
    except OSError as exc:
        log.error("listen_failed", url=f"http://{args.host}:{args.port}", error=str(exc))
        return 1
    return 0


command = SimpleCommand(
    "proxy", "an OpenAI endpoint that prefills on one vLLM and decodes on another, through kvdepot", configure, run
)
