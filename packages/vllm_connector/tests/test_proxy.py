"""`kvdepot proxy` against two stand-in vLLM servers (a unit test: small aiohttp apps that record
what they get and answer as vLLM's OpenAI server does). tests/vllm/test_disaggregation.py runs it
in front of real vLLM servers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

from kvdepot.vllm_connector._proxy import make_app  # noqa: E402

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
