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
needs aiohttp, which vLLM's OpenAI server depends on.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import structlog

from kvdepot.server import SimpleCommand, configure_logging

if TYPE_CHECKING:
    from aiohttp import ClientSession, web

log = structlog.get_logger("kvdepot.proxy")

#: Routes passed through the prefill step; other paths of the OpenAI API go to a decode server.
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")
#: Request headers passed on to the vLLM servers (an API key, a request id).
FORWARDED_HEADERS = ("Authorization", "X-Request-Id")
#: The largest request body accepted (a long prompt's token ids as JSON).
MAX_BODY_BYTES = 64 << 20


class Proxy:
    """The proxy's state: the servers to use in turn, and one HTTP client session."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, timeout: float) -> None:
        self._prefill: Iterator[str] = itertools.cycle([url.rstrip("/") for url in prefill])
        self._decode: Iterator[str] = itertools.cycle([url.rstrip("/") for url in decode])
        self.timeout = timeout
        self.session: ClientSession | None = None
        self.counts = {"requests": 0, "prefill_failures": 0}

    async def start(self, app: web.Application) -> None:
        import aiohttp

        # No cap on connections (streamed decodes hold theirs); a silent server fails a request
        # after `timeout` seconds without a byte, however long a streamed answer runs.
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.timeout),
        )

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def complete(self, request: web.Request) -> web.StreamResponse:
        """Prefill, then decode with the prefill's ``kv_transfer_params``; the decode answer streams back."""
        from aiohttp import web

        try:
            body = await request.json()
        except ValueError:
            raise web.HTTPBadRequest(text="the request body is not JSON") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="the request body is not a JSON object")
        self.counts["requests"] += 1
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        params = await self._prefill_params(request.path, body, headers)
        body = {key: value for key, value in body.items() if key != "kv_transfer_params"}  # never the client's
        if params is not None:
            body["kv_transfer_params"] = params
        return await self._relay(request, next(self._decode) + request.path, body, headers)

    async def _prefill_params(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        """The prefill server's ``kv_transfer_params`` for ``body``; None where it failed (logged)."""
        import aiohttp

        assert self.session is not None
        prefill = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        prefill.pop("stream_options", None)
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        url = next(self._prefill) + path
        try:
            async with self.session.post(url, json=prefill, headers=headers) as reply:
                if reply.status == 200:
                    answer = await reply.json()
                    if isinstance(answer, dict):
                        return answer.get("kv_transfer_params")
                    why = "the answer is not a JSON object"
                else:
                    why = f"HTTP {reply.status}: {(await reply.text())[:300]}"
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            why = repr(exc)
        self.counts["prefill_failures"] += 1
        log.warning("prefill_failed", url=url, error=why, then="the decode server computes the whole prompt")
        return None

    async def _relay(
        self, request: web.Request, url: str, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """POST ``body`` to ``url`` and pass its answer back as it arrives."""
        import aiohttp
        from aiohttp import web

        assert self.session is not None
        response: web.StreamResponse | None = None
        try:
            async with self.session.post(url, json=body, headers=headers) as reply:
                response = web.StreamResponse(status=reply.status)
                response.content_type = reply.content_type
                await response.prepare(request)
                async for piece in reply.content.iter_any():
                    await response.write(piece)
                await response.write_eof()
                return response
        except (aiohttp.ClientError, TimeoutError, ConnectionResetError) as exc:
            log.warning("decode_failed", url=url, error=repr(exc))
            if response is None or not response.prepared:
                raise web.HTTPBadGateway(text=f"the decode server {url} failed: {exc!r}") from None
            return response  # its headers are out: the client sees the stream end early

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """Any other GET of the API (``/v1/models``, ...) from a decode server."""
        import aiohttp
        from aiohttp import web

        assert self.session is not None
        url = next(self._decode) + request.path_qs
        headers = {name: request.headers[name] for name in FORWARDED_HEADERS if name in request.headers}
        try:
            async with self.session.get(url, headers=headers) as reply:
                return web.Response(status=reply.status, body=await reply.read(), content_type=reply.content_type)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise web.HTTPBadGateway(text=f"the decode server {url} failed: {exc!r}") from None

    async def health(self, request: web.Request) -> web.Response:
        """200 while the proxy runs (each vLLM server has its own /health)."""
        from aiohttp import web

        return web.json_response({"status": "ok", **self.counts})


def make_app(prefill: Sequence[str], decode: Sequence[str], *, timeout: float = 600.0) -> web.Application:
    """The proxy as an aiohttp application (`kvdepot proxy` runs it)."""
    from aiohttp import web

    proxy = Proxy(prefill, decode, timeout=timeout)
    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.on_startup.append(proxy.start)
    app.on_cleanup.append(proxy.stop)
    for path in COMPLETION_PATHS:
        app.router.add_post(path, proxy.complete)
    app.router.add_get("/health", proxy.health)
    app.router.add_get("/v1/{tail:.*}", proxy.passthrough)
    return app


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
        "--timeout", type=float, default=600.0, help="seconds a vLLM server may stay silent in a request (default 600)"
    )


def run(args: argparse.Namespace) -> int:
    try:
        from aiohttp import web
    except ImportError:
        configure_logging("auto", "info", stream="stderr")
        log.error("aiohttp_missing", fix="pip install aiohttp (vLLM's OpenAI server depends on it)")
        return 1
    configure_logging("auto", "info", stream="stderr")
    app = make_app(args.prefill, args.decode, timeout=args.timeout)
    log.info("proxy_listening", url=f"http://{args.host}:{args.port}", prefill=args.prefill, decode=args.decode)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0


command = SimpleCommand(
    "proxy", "an OpenAI endpoint that prefills on one vLLM and decodes on another, through kvdepot", configure, run
)
