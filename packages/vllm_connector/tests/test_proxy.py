"""`kvdepot proxy` against two stand-in vLLM servers (a unit test: small aiohttp apps that record
what they get and answer as vLLM's OpenAI server does). tests/vllm/test_disaggregation.py runs it
in front of real vLLM servers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import resource
import subprocess
import sys
from asyncio.subprocess import Process
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvdepot.vllm_connector._proxy import make_app  # noqa: E402
from kvdepot.vllm_connector._proxy_guard import ProxyLimits  # noqa: E402

PARAMS = {"kvdepot": {"version": 1, "namespace": "ab" * 16, "chunks": 3}}


def stand_in(seen: list[dict[str, Any]], *, prefill: bool, status: int = 200) -> web.Application:
    """A vLLM server's completions endpoint: records each body; a prefill answers kv_transfer_params,
    a decode streams three events when asked to stream."""

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({**body, "_auth": request.headers.get("Authorization")})
        if status != 200:
            return web.Response(status=status, text="engine is sleeping")
        if prefill:
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if body.get("stream"):
            response = web.StreamResponse()
            response.content_type = "text/event-stream"
            await response.prepare(request)
            for i in range(3):
                await response.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        return web.json_response({"choices": [{"text": "decoded"}], "got_params": body.get("kv_transfer_params")})

    async def models(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != "Bearer k":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response({"data": [{"id": "m"}]})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/v1/models", models)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def through_proxy(prefill_status: int, requests: list[tuple[str, dict[str, Any]]]) -> tuple[list, list, list]:
    prefill_seen: list[dict[str, Any]] = []
    decode_seen: list[dict[str, Any]] = []
    runners = []
    p_runner, p_url = await serve(stand_in(prefill_seen, prefill=True, status=prefill_status))
    d_runner, d_url = await serve(stand_in(decode_seen, prefill=False))
    x_runner, x_url = await serve(make_app([p_url], [d_url], timeout=30))
    runners += [p_runner, d_runner, x_runner]
    answers = []
    try:
        async with aiohttp.ClientSession() as session:
            for path, body in requests:
                async with session.post(x_url + path, json=body, headers={"Authorization": "Bearer k"}) as reply:
                    answers.append((reply.status, reply.content_type, await reply.read()))
            async with session.get(x_url + "/v1/models", headers={"Authorization": "Bearer k"}) as reply:
                answers.append((reply.status, reply.content_type, await reply.read()))
    finally:
        for runner in runners:
            await runner.cleanup()
    return prefill_seen, decode_seen, answers


def test_the_prefill_gets_one_token_and_the_decode_gets_its_kv_transfer_params():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "stream_options": {"include_usage": True}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
    prefill, decode, answers = asyncio.run(
        through_proxy(200, [("/v1/completions", body), ("/v1/chat/completions", chat)])
    )
    assert prefill[0]["max_tokens"] == 1
    assert prefill[0]["stream"] is False
    assert "stream_options" not in prefill[0]
    assert prefill[0]["kv_transfer_params"] == {"do_remote_decode": True}
    assert prefill[1]["max_completion_tokens"] == 1
    assert decode[0]["max_tokens"] == 8  # the client's own request
    assert decode[0]["kv_transfer_params"] == PARAMS
    assert decode[1]["kv_transfer_params"] == PARAMS
    assert {seen["_auth"] for seen in prefill + decode} == {"Bearer k"}
    assert json.loads(answers[0][2])["got_params"] == PARAMS
    assert answers[2][0] == 200  # GET /v1/models from the decode server
    assert json.loads(answers[2][2]) == {"data": [{"id": "m"}]}


def test_a_stream_is_passed_back_as_the_decode_server_sends_it():
    body = {"model": "m", "prompt": "hello", "max_tokens": 8, "stream": True}
    prefill, _, answers = asyncio.run(through_proxy(200, [("/v1/completions", body)]))
    status, content_type, data = answers[0]
    assert (status, content_type) == (200, "text/event-stream")
    assert data.decode().count("data: ") == 4
    assert data.endswith(b"data: [DONE]\n\n")
    assert prefill[0]["stream"] is False


def test_a_failed_prefill_still_answers_from_the_decode_server_without_params():
    """Nor with the client's own: a client cannot hand a decode server a handoff of its choosing."""
    forged = {"kvdepot": {"version": 1, "namespace": "00" * 16, "chunks": 99}}
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 8, "kv_transfer_params": forged}
    _, decode, answers = asyncio.run(through_proxy(503, [("/v1/completions", body)]))
    assert answers[0][0] == 200
    assert "kv_transfer_params" not in decode[0]


def test_a_body_that_is_not_json_is_a_400():
    async def run() -> int:
        runner, url = await serve(make_app(["http://127.0.0.1:1"], ["http://127.0.0.1:1"]))
        try:
            async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", data=b"{") as reply:
                return reply.status
        finally:
            await runner.cleanup()

    assert asyncio.run(run()) == 400


# -- bounds (issue 45): what a hostile local client gets -----------------------------------------


async def raw_request(url: str, target: str, *, method: str = "GET", body: bytes = b"") -> tuple[int, bytes]:
    """One request with `target` sent exactly as written (aiohttp's client would resolve its dot segments)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = f"{method} {target} HTTP/1.0\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"  # 1.0: no chunks
    writer.write(head.encode() + body)
    answer = await reader.read()
    writer.close()
    status_line, _, rest = answer.partition(b"\r\n")
    return int(status_line.split()[1]), rest.partition(b"\r\n\r\n")[2]


async def scrape(session: Any, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The proxy's /metrics as {(sample name, labels): value}."""
    async with session.get(url + "/metrics") as reply:
        assert reply.status == 200
        return parse_figures(await reply.text())


def parse_figures(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def refused(figures: dict, reason: str) -> float:
    return figures[("kvdepot_proxy_refused_total", (("reason", reason),))]


class Backend:
    """A stand-in vLLM server, prefill or decode, that records what reaches it and can hold or cut its answers."""

    def __init__(self, *, prefill: bool) -> None:
        self.prefill = prefill
        self.seen: list[str] = []  # the paths asked for, as the server read them
        self.gate: asyncio.Event | None = None  # while set to an unset event, answers wait for it
        self.waiting = 0
        self.cut = False  # answers stop midway: the connection closes before their end

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_get("/{tail:.*}", self.get)
        return app

    async def get(self, request: web.Request) -> web.Response:
        self.seen.append(request.path)
        return web.json_response({"path": request.path})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(request.path)
        if self.prefill:
            await self._wait()
            return web.json_response({"choices": [{"text": "x"}], "kv_transfer_params": PARAMS})
        if not body.get("stream"):
            if self.cut:  # says 1,000 bytes, sends 20, and goes
                response = web.StreamResponse(headers={"Content-Length": "1000"})
                response.content_type = "application/json"
                await response.prepare(request)
                await response.write(b'{"choices": [{"text"')
                request.transport.close()  # type: ignore[union-attr]
                return response
            return web.json_response({"choices": [{"text": "decoded"}]})
        response = web.StreamResponse()
        response.content_type = "text/event-stream"
        await response.prepare(request)
        await response.write(b'data: {"i": 0}\n\n')
        await self._wait()
        await response.write(b'data: {"i": 1}\n\n')
        if self.cut:
            request.transport.close()  # type: ignore[union-attr]
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def _wait(self) -> None:
        if self.gate is not None:
            self.waiting += 1
            await self.gate.wait()
            self.waiting -= 1


async def with_proxy(test: Any, **options: Any) -> Any:
    """Run `test(session, proxy_url, prefill, decode)` against a proxy (make_app(**options)) and two backends."""
    prefill, decode = Backend(prefill=True), Backend(prefill=False)
    p_runner, p_url = await serve(prefill.app())
    d_runner, d_url = await serve(decode.app())
    x_runner, x_url = await serve(make_app([p_url], [d_url], timeout=30, **options))
    try:
        async with aiohttp.ClientSession() as session:
            return await test(session, x_url, prefill, decode)
    finally:
        for runner in (x_runner, d_runner, p_runner):
            await runner.cleanup()


async def until(condition: Any) -> None:
    """Wait for `condition()` to hold (at most 30 s: a bound on the wait, not on how fast the machine is)."""
    for _ in range(3000):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the condition never held")


SMALL = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}


def test_a_body_past_max_body_is_a_413_and_a_small_request_still_succeeds():
    """The default --max-body is 8 MiB: a 9 MiB body is refused before it is read or decoded."""
    big = json.dumps({"model": "m", "prompt": "x" * (9 << 20)}).encode()

    async def test(session: Any, url: str, prefill: Backend, decode: Backend) -> None:
        async with session.post(url + "/v1/completions", data=big) as reply:
            assert reply.status == 413
            assert "--max-body" in (await reply.json())["error"]["message"]

        # sent in chunks, with no Content-Length to refuse it by: refused once 8 MiB have arrived
        async def chunks() -> Any:
            for i in range(0, len(big), 65536):
                yield big[i : i + 65536]

        async with session.post(url + "/v1/completions", data=chunks()) as reply:
            assert reply.status == 413
        async with session.post(url + "/v1/completions", json=SMALL) as reply:
            assert reply.status == 200
            assert (await reply.json())["choices"][0]["text"] == "decoded"
        assert prefill.seen == ["/v1/completions"]  # only the small one went on
        figures = await scrape(session, url)
        assert refused(figures, "body_too_large") == 2
        assert figures[("kvdepot_proxy_requests_total", (("route", "completion"),))] == 3
        assert figures[("kvdepot_proxy_body_bytes_held", ())] == 0
        assert figures[("kvdepot_proxy_limit", (("name", "max_body"),))] == 8 << 20

    asyncio.run(with_proxy(test))


def test_requests_past_max_requests_get_a_503_and_are_served_again_once_some_end():
    async def test(session: Any, url: str, prefill: Backend, decode: Backend) -> None:
        decode.gate = asyncio.Event()
        streams = []
        for _ in range(2):
            reply = await session.post(url + "/v1/completions", json={**SMALL, "stream": True})
            assert reply.status == 200
            streams.append(reply)
        await until(lambda: decode.waiting == 2)
        async with session.post(url + "/v1/completions", json=SMALL) as reply:
            assert reply.status == 503
            assert reply.headers["Retry-After"] == "1"
        async with session.get(url + "/v1/models") as reply:
            assert reply.status == 503
        figures = await scrape(session, url)  # /metrics and /health answer while the proxy is full
        assert figures[("kvdepot_proxy_requests_in_flight", ())] == 2
        assert refused(figures, "busy") == 2
        decode.gate.set()
        for reply in streams:
            assert (await reply.read()).endswith(b"data: [DONE]\n\n")
            reply.release()
        async with session.post(url + "/v1/completions", json=SMALL) as reply:
            assert reply.status == 200
        assert (await scrape(session, url))[("kvdepot_proxy_requests_in_flight", ())] == 0

    asyncio.run(with_proxy(test, limits=ProxyLimits(max_requests=2)))


def test_bodies_held_past_max_body_total_get_a_503():
    """Each body counts three times (as read, and re-encoded for each server) until the decode server has it."""
    body = json.dumps({**SMALL, "prompt": "x" * 900}).encode()

    async def test(session: Any, url: str, prefill: Backend, decode: Backend) -> None:
        prefill.gate = asyncio.Event()
        first = asyncio.create_task(session.post(url + "/v1/completions", data=body))
        await until(lambda: prefill.waiting == 1)
        assert (await scrape(session, url))[("kvdepot_proxy_body_bytes_held", ())] == 3 * len(body)
        async with session.post(url + "/v1/completions", data=body) as reply:
            assert reply.status == 503
            assert "--max-body-total" in (await reply.json())["error"]["message"]
        prefill.gate.set()
        reply = await first
        assert reply.status == 200
        reply.release()
        async with session.post(url + "/v1/completions", data=body) as reply:
            assert reply.status == 200
        figures = await scrape(session, url)
        assert refused(figures, "body_budget") == 1
        assert figures[("kvdepot_proxy_body_bytes_held", ())] == 0

    asyncio.run(with_proxy(test, limits=ProxyLimits(max_body=1000, max_body_total=4000)))


def test_a_body_sent_slower_than_body_timeout_is_a_408_and_frees_what_it_held():
    async def test(session: Any, url: str, prefill: Backend, decode: Backend) -> None:
        host, port = url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.0\r\nHost: x\r\nContent-Length: 900\r\n\r\n{")
        status_line = await reader.readline()  # the proxy answers without the other 899 bytes
        writer.close()
        assert status_line.split()[1] == b"408"
        figures = await scrape(session, url)
        assert refused(figures, "body_timeout") == 1
        assert figures[("kvdepot_proxy_body_bytes_held", ())] == 0
        assert prefill.seen == []

    asyncio.run(with_proxy(test, body_timeout=0.2))


ESCAPES = [
    "/v1/../metrics",
    "/v1/%2e%2e/metrics",
    "/v1/%2E%2E/metrics",
    "/v1/models/../../metrics",
    "/v1/models/%2e%2e/%2e%2e/metrics",
    "/v1/..%2fmetrics",
    "/v1/%2e%2e%2fmetrics",
    "/v1/.%2e/metrics",
    "/v1/./../metrics",
    "/v1//../metrics",
    "/v1/%5c..%5cmetrics",
]


def test_passthrough_never_leaves_v1():
    async def test(session: Any, url: str, prefill: Backend, decode: Backend) -> None:
        for target in ESCAPES:
            status, _ = await raw_request(url, target)
            assert status == 400, target
        status, _ = await raw_request(url, "/v1%2f..%2fmetrics")  # not under /v1/ (aiohttp's own 404)
        assert status == 404
        assert decode.seen == []
        status, body = await raw_request(url, "/v1/%6dodels?x=1")  # an escaped letter is the same path
        assert (status, json.loads(body)) == (200, {"path": "/v1/models"})
        status, body = await raw_request(url, "/v1/a%20b")
        assert (status, json.loads(body)) == (200, {"path": "/v1/a b"})
        assert decode.seen == ["/v1/models", "/v1/a b"]
        assert refused(await scrape(session, url), "bad_path") == len(ESCAPES)

    asyncio.run(with_proxy(test))


def test_a_decode_answer_cut_midway_reaches_the_client_cut():
    async def test(session: Any, url: str, prefill: Backend, decode: Backend) -> None:
        decode.cut = True
        got = b""
        async with session.post(url + "/v1/completions", json={**SMALL, "stream": True}) as reply:
            assert reply.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):  # noqa: PT012 (the pieces before the cut are kept)
                async for piece in reply.content.iter_any():
                    got += piece
        events = [line for line in got.decode().split("\n\n") if line]
        assert events[:2] == ['data: {"i": 0}', 'data: {"i": 1}']
        assert json.loads(events[2].removeprefix("data: "))["error"]["code"] == 502
        assert b"[DONE]" not in got
        async with session.post(url + "/v1/completions", json=SMALL) as reply:
            assert reply.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await reply.read()
        decode.cut = False
        async with session.post(url + "/v1/completions", json={**SMALL, "stream": True}) as reply:
            assert (await reply.read()).endswith(b"data: [DONE]\n\n")
        figures = await scrape(session, url)
        assert figures[("kvdepot_proxy_cut_streams_total", ())] == 2
        assert figures[("kvdepot_proxy_upstream_errors_total", (("server", "decode"),))] == 2

    asyncio.run(with_proxy(test))


def test_malformed_or_deeply_nested_json_is_a_400():
    bodies = {
        b'{"prompt": ' + b"[" * 100_000 + b"1" + b"]" * 100_000 + b"}": "too deep",
        b'{"prompt": ' + b"[" * 100_000: "too deep",
        b'{"prompt": [1, 2,]}': "not JSON",
        b'{"prompt": 1} trailing': "not JSON",
        b"[1, 2]": "not a JSON object",
    }

    async def test(session: Any, url: str, prefill: Backend, decode: Backend) -> None:
        for body, why in bodies.items():
            async with session.post(url + "/v1/completions", data=body) as reply:
                assert reply.status == 400, body[:40]
                assert why in (await reply.json())["error"]["message"]
        async with session.post(url + "/v1/completions", json=SMALL) as reply:
            assert reply.status == 200
        assert prefill.seen == ["/v1/completions"]
        assert refused(await scrape(session, url), "bad_json") == len(bodies)

    asyncio.run(with_proxy(test))


@contextlib.asynccontextmanager
async def proxy_process(
    tmp_path: Path, *flags: str, file_limit: int | None = None
) -> AsyncIterator[tuple[Process, str]]:
    """`kvdepot proxy *flags` as a process in front of two stand-in backends, once its /metrics answers;
    with `file_limit`, its soft and hard limit of file descriptors."""
    from kvdepot.server.testing import free_port

    prefill, decode = Backend(prefill=True), Backend(prefill=False)
    p_runner, p_url = await serve(prefill.app())
    d_runner, d_url = await serve(decode.app())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = ["proxy", "--prefill", p_url, "--decode", d_url, "--port", str(port), *flags]
    with (tmp_path / "proxy.log").open("wb") as log:
        proxy = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvdepot.server",
            *argv,
            stderr=log,
            preexec_fn=None
            if file_limit is None
            else lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (file_limit,) * 2),
        )
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                try:
                    await scrape(session, url)
                    break
                except aiohttp.ClientConnectionError:
                    assert proxy.returncode is None, (tmp_path / "proxy.log").read_text()
                    await asyncio.sleep(0.1)
            else:
                raise AssertionError((tmp_path / "proxy.log").read_text())
        yield proxy, url
    finally:
        if proxy.returncode is None:
            proxy.terminate()
        await proxy.wait()
        await d_runner.cleanup()
        await p_runner.cleanup()


def test_the_limits_are_flags_of_kvdepot_proxy(tmp_path):
    """`kvdepot proxy` as a process: its flags set the bounds that /metrics shows and clients meet."""
    flags = ["--max-body", "1KiB", "--max-body-total", "1MiB", "--max-requests", "7", "--body-timeout", "5"]
    flags += ["--max-connections", "9", "--header-timeout", "3", "--keepalive-timeout", "4"]

    async def test() -> None:
        async with proxy_process(tmp_path, *flags) as (_, url), aiohttp.ClientSession() as session:
            figures = await scrape(session, url)
            limits = {labels[0][1]: value for (name, labels), value in figures.items() if name == "kvdepot_proxy_limit"}
            assert limits == {
                "max_body": 1024,
                "max_body_total": 1 << 20,
                "max_requests": 7,
                "max_connections": 9,
                "header_timeout": 3,
                "keepalive_timeout": 4,
            }
            async with session.post(url + "/v1/completions", json={**SMALL, "prompt": "x" * 2000}) as reply:
                assert reply.status == 413
            async with session.post(url + "/v1/completions", json=SMALL) as reply:
                assert reply.status == 200
            assert refused(await scrape(session, url), "body_too_large") == 1

    asyncio.run(test())
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvdepot.server",
            "proxy",
            "--prefill",
            "http://x",
            "--decode",
            "http://y",
            "--max-body",
            "1MiB",
            "--max-body-total",
            "2MiB",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode == 2
    assert "max_body_total" in bad.stderr


# -- client connections (issue 45): a cap, a deadline for each request's head, idle ones closed --------


async def answer(reader: asyncio.StreamReader) -> bytes:
    """What a connection gets until the proxy closes it (b"" where it was reset)."""
    try:
        return await reader.read()
    except ConnectionResetError:
        return b""


async def read_response(reader: asyncio.StreamReader) -> int:
    """One whole answer of a kept-alive connection: its status."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
    assert length is not None, head
    await reader.readexactly(int(length.group(1)))
    return int(head.split()[1])


async def figures_of(url: str) -> dict | None:
    """The proxy's /metrics over HTTP/1.0, a connection the proxy closes itself (so no longer counts once
    read); None where the proxy refused the connection."""
    try:
        status, body = await raw_request(url, "/metrics")
    except (ConnectionError, IndexError):  # reset, or closed without a word
        return None
    return parse_figures(body.decode()) if status == 200 else None


async def settled(url: str) -> dict:
    """The proxy's figures once the connection that asks for them is the only one open."""
    for _ in range(300):
        figures = await figures_of(url)
        if figures is not None and figures[("kvdepot_proxy_connections", ())] == 1:
            return figures
        await asyncio.sleep(0.1)
    raise AssertionError("connections stayed open")


def closed(figures: dict, reason: str) -> float:
    return figures[("kvdepot_proxy_connections_closed_total", (("reason", reason),))]


def one_connection_each() -> Any:
    """A client session that closes each connection after its request (a kept one would count against the cap)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


def test_max_connections_stays_below_the_file_limit(tmp_path):
    """Where the hard file limit is low, --max-connections is lowered to what it leaves beside one
    descriptor per request in flight and a reserve, so the proxy never runs out of descriptors."""

    async def test() -> None:
        async with proxy_process(tmp_path, "--max-requests", "100", file_limit=400) as (_, url):
            figures = await settled(url)
            assert figures[("kvdepot_proxy_limit", (("name", "max_connections"),))] == 400 - 100 - 64

    asyncio.run(test())
    assert "connections_capped" in (tmp_path / "proxy.log").read_text()
    no_room = subprocess.run(
        [sys.executable, "-m", "kvdepot.server", "proxy", "--prefill", "http://x", "--decode", "http://y"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (300, 300)),  # 256 requests + 64 do not fit
    )
    assert no_room.returncode == 2
    assert "--max-requests" in no_room.stderr


def test_connections_past_max_connections_get_a_503_unread_and_the_proxy_stays_bounded(tmp_path):
    """Idle connections fill --max-connections; the ones past it are answered at once and counted, the
    proxy keeps at most the cap open (its file descriptors too), and serves again once they go."""
    cap, extra = 8, 30

    async def test() -> None:
        async with (
            proxy_process(tmp_path, "--max-connections", str(cap), "--header-timeout", "600") as (proxy, url),
            one_connection_each() as session,
        ):
            await settled(url)
            files_before = len(os.listdir(f"/proc/{proxy.pid}/fd"))
            host, port = url.removeprefix("http://").split(":")
            attackers = [await asyncio.open_connection(host, int(port)) for _ in range(cap + extra)]
            answers = [asyncio.ensure_future(answer(reader)) for reader, _ in attackers]
            await until(lambda: sum(a.done() for a in answers) >= extra)
            assert proxy.returncode is None
            assert len(os.listdir(f"/proc/{proxy.pid}/fd")) <= files_before + cap
            for got in (a.result() for a in answers if a.done()):
                assert got == b"" or got.startswith(b"HTTP/1.1 503 "), got[:80]  # never a byte of it read
            assert any(a.result().startswith(b"HTTP/1.1 503 ") for a in answers if a.done())
            held = [writer for (_, writer), a in zip(attackers, answers, strict=True) if not a.done()]
            assert len(held) == cap
            held[0].close()  # room for one scrape
            refused_scrapes = 0
            for _ in range(300):
                figures = await figures_of(url)
                if figures is not None:
                    break
                refused_scrapes += 1
                await asyncio.sleep(0.1)
            else:
                raise AssertionError("no room for a scrape")
            assert figures[("kvdepot_proxy_connections", ())] == cap
            assert closed(figures, "full") == extra + refused_scrapes
            for writer in held[1:]:
                writer.close()
            await settled(url)
            async with session.post(url + "/v1/completions", json=SMALL) as reply:
                assert reply.status == 200

    asyncio.run(test())


def test_idle_connections_are_cut_at_header_timeout_and_a_good_client_is_served_after(tmp_path):
    """Connections that send nothing hold the cap only until --header-timeout (a 408), and one kept
    alive after a request is closed after --keepalive-timeout; both are counted."""
    cap = 4

    async def test() -> None:
        flags = ["--max-connections", str(cap), "--header-timeout", "2", "--keepalive-timeout", "2"]
        async with proxy_process(tmp_path, *flags) as (proxy, url), one_connection_each() as session:
            await settled(url)
            host, port = url.removeprefix("http://").split(":")
            attackers = [await asyncio.open_connection(host, int(port)) for _ in range(cap)]
            answers = await asyncio.wait_for(asyncio.gather(*(answer(reader) for reader, _ in attackers)), 60)
            assert all(got.startswith(b"HTTP/1.1 408 ") for got in answers), answers
            assert proxy.returncode is None
            async with session.post(url + "/v1/completions", json=SMALL) as reply:
                assert reply.status == 200
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await read_response(reader) == 200
            assert await asyncio.wait_for(answer(reader), 60) == b""  # closed idle, without a word
            figures = await settled(url)
            assert closed(figures, "header_timeout") == cap
            assert closed(figures, "idle") == 1
            assert closed(figures, "full") == 0

    asyncio.run(test())


#: A request head sent a byte at a time takes 25 s at this pace: ten times --header-timeout in the test.
DRIP_GAP_S = 0.05
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 450 + b"\r\n\r\n"


async def drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes) -> tuple[int, bytes]:
    """Send `head` a byte every `DRIP_GAP_S` until the proxy closes the connection: (bytes sent, its answer)."""
    got = asyncio.ensure_future(answer(reader))
    sent = 0
    while sent < len(head) and not got.done():
        try:
            writer.write(head[sent : sent + 1])
            await writer.drain()
        except ConnectionError:
            break
        sent += 1
        await asyncio.sleep(DRIP_GAP_S)
    return sent, await asyncio.wait_for(got, 60)


def test_a_head_sent_a_byte_at_a_time_is_cut_at_its_deadline_however_often_bytes_come(tmp_path):
    """Slow-loris: each byte arrives well within any per-read timeout, but the head as a whole must arrive
    within --header-timeout, on a new connection and on a kept-alive one alike."""

    async def test() -> None:
        flags = ["--header-timeout", "2", "--keepalive-timeout", "600"]
        async with proxy_process(tmp_path, *flags) as (proxy, url):
            host, port = url.removeprefix("http://").split(":")
            sent, got = await drip(*await asyncio.open_connection(host, int(port)), SLOW_HEAD)
            assert sent < len(SLOW_HEAD)
            assert got == b"" or got.startswith(b"HTTP/1.1 408 "), got[:80]
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert await read_response(reader) == 200
            sent, got = await drip(reader, writer, SLOW_HEAD)  # the next request's head: its own deadline
            assert sent < len(SLOW_HEAD)
            assert got == b"" or got.startswith(b"HTTP/1.1 408 "), got[:80]
            assert proxy.returncode is None
            figures = await settled(url)
            assert closed(figures, "header_timeout") == 2
            assert closed(figures, "idle") == 0

    asyncio.run(test())
