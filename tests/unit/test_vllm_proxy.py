"""The vLLM prefill/decode proxy against fake vLLM OpenAI servers.

Everything runs in-process on 127.0.0.1 (OS-chosen ports), one event loop per test, every
test bounded by ``LIMIT`` seconds. The fakes answer like vLLM with a P/D connector: a
prefill hop (``do_remote_decode``) gets ``kv_transfer_params`` back, a decode hop a
completion.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from kvhandoff.lab.cli import main as cli_main
from kvhandoff.lab.servers import free_port
from kvhandoff.lab.vllm.proxy import (
    DECODE_MS,
    FAILED_HOP,
    PREFILL_MS,
    make_app,
    prefill_body,
)

LIMIT = 10.0  # seconds any one test may take; a hang fails instead of blocking the suite

Answer = Callable[[web.Request, dict[str, Any]], Awaitable[web.StreamResponse]]

REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False,
                 "remote_engine_id": None, "remote_block_ids": None, "remote_host": None,
                 "remote_port": None}


def run(coro: Coroutine[Any, Any, None]) -> None:
    async def bounded() -> None:
        async with asyncio.timeout(LIMIT):
            await coro

    asyncio.run(bounded())



@dataclass
class Seen:
    path: str
    headers: Mapping[str, str]  # case-insensitive
    body: dict[str, Any]


class Fake:
    """A fake vLLM OpenAI server that records every request; ``answer`` overrides the
    default P/D-enabled behaviour."""

    def __init__(self, name: str, answer: Answer | None = None) -> None:
        self.name = name
        self.seen: list[Seen] = []
        self.answer = answer or self.default
        app = web.Application()
        app.router.add_post("/v1/completions", self._handle)
        app.router.add_post("/v1/chat/completions", self._handle)
        app.router.add_get("/v1/models", self._models)
        self.server = TestServer(app, host="127.0.0.1")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"

    def params(self) -> dict[str, Any]:
        """The kv_transfer_params this server's prefill answers."""
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.name, "remote_block_ids": [3, 4],
                "remote_host": "127.0.0.1", "remote_port": 5600}

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, request.headers.copy(), body))
        return await self.answer(request, body)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.name}]})

    async def default(self, request: web.Request, body: dict[str, Any]) -> web.Response:
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return web.json_response({"id": "cmpl-p", "choices": [{"text": "x"}],
                                      "kv_transfer_params": self.params()})
        return web.json_response({"id": "cmpl-d", "served_by": self.name,
                                  "choices": [{"text": " world"}]})


@asynccontextmanager
async def cluster(prefill: list[Fake], decode: list[Fake], *, prefill_urls: Sequence[str] = (),
                  handler_cancellation: bool = True, **kw: Any
                  ) -> AsyncIterator[aiohttp.ClientSession]:
    """Start the fakes and a proxy in front of them; yield a client session on the proxy.

    The proxy runs like ``serve`` runs it (handler cancellation on, unless told otherwise).
    """
    fakes = prefill + decode
    for fake in fakes:
        await fake.server.start_server()
    app = make_app([*(f.url for f in prefill), *prefill_urls], [f.url for f in decode], **kw)
    runner = web.AppRunner(app, handler_cancellation=handler_cancellation)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
            yield client
    finally:
        await runner.cleanup()
        for fake in fakes:
            await fake.server.close()


COMPLETION = {"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0.0,
              "min_tokens": 2}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": 16, "max_tokens": 32}


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION),
                                            ("/v1/chat/completions", CHAT)])
def test_round_trip(path: str, body: dict[str, Any]) -> None:
    async def go() -> None:
        p, d = Fake("p0"), Fake("d0")
        async with cluster([p], [d]) as client:
            hdr = {"X-Request-Id": "req-1", "Authorization": "Bearer k"}
            async with client.post(path, json=body, headers=hdr) as r:
                assert r.status == 200, await r.text()
                assert await r.json() == {"id": "cmpl-d", "served_by": "d0",
                                          "choices": [{"text": " world"}]}
                assert r.headers["X-Request-Id"] == "req-1"
                assert float(r.headers[PREFILL_MS]) >= 0
                assert float(r.headers[DECODE_MS]) >= 0
                assert FAILED_HOP not in r.headers
        [pre], [dec] = p.seen, d.seen
        assert pre.path == dec.path == path
        expected_pre = {k: v for k, v in body.items() if k != "min_tokens"}
        expected_pre |= {"max_tokens": 1, "stream": False, "kv_transfer_params": REMOTE_DECODE}
        if "max_completion_tokens" in body:
            expected_pre["max_completion_tokens"] = 1
        assert pre.body == expected_pre
        assert dec.body == {**body, "kv_transfer_params": p.params()}
        for seen in (pre, dec):
            assert seen.headers["X-Request-Id"] == "req-1"
            assert seen.headers["Authorization"] == "Bearer k"

    run(go())


def test_request_id_generated_when_absent() -> None:
    async def go() -> None:
        p, d = Fake("p0"), Fake("d0")
        async with cluster([p], [d]) as client, \
                client.post("/v1/completions", json=COMPLETION) as r:
            assert r.status == 200
            rid = r.headers["X-Request-Id"]
        assert uuid.UUID(rid).version == 4
        assert p.seen[0].headers["X-Request-Id"] == d.seen[0].headers["X-Request-Id"] == rid
        assert "Authorization" not in p.seen[0].headers

    run(go())


def test_streaming_passthrough_chunk_by_chunk() -> None:
    chunks = [f'data: {{"choices": [{{"text": "t{i}"}}]}}\n\n'.encode() for i in range(4)]
    chunks.append(b"data: [DONE]\n\n")
    gates = [asyncio.Event() for _ in chunks]

    async def sse(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if not body.get("stream"):
            raise AssertionError("the decode hop lost stream: true")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk, gate in zip(chunks, gates, strict=True):
            await resp.write(chunk)
            await gate.wait()  # the next chunk only once the client saw this one
        await resp.write_eof()
        return resp

    async def go() -> None:
        p, d = Fake("p0"), Fake("d0", sse)
        body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
        async with cluster([p], [d]) as client, \
                client.post("/v1/completions", json=body) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/event-stream")
            assert float(r.headers[PREFILL_MS]) >= 0
            got = b""
            for i, gate in enumerate(gates):
                # A proxy that buffered would never pass chunk i before the fake sent the
                # rest, and the fake sends the rest only after this loop saw chunk i.
                want = b"".join(chunks[:i + 1])
                while len(got) < len(want):
                    data = await r.content.readany()
                    assert data, f"stream ended after {got!r}"
                    got += data
                assert got == want
                gate.set()
            assert await r.content.read() == b""
        assert "stream_options" not in p.seen[0].body
        assert p.seen[0].body["stream"] is False
        assert d.seen[0].body == {**body, "kv_transfer_params": p.params()}

    run(go())


def test_decode_stream_breaking_truncates_the_client_stream() -> None:
    async def broken(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {}\n\n")
        assert request.transport is not None
        request.transport.close()  # the decode server dies mid-stream
        return resp

    async def go() -> None:
        async with cluster([Fake("p0")], [Fake("d0", broken)]) as client, \
                client.post("/v1/completions", json={**COMPLETION, "stream": True}) as r:
            assert r.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await r.content.read()

    run(go())


@pytest.mark.parametrize("handler_cancellation", [True, False])
def test_client_leaving_mid_stream_drops_the_decode_connection(
        handler_cancellation: bool) -> None:
    seen_first, aborted = asyncio.Event(), asyncio.Event()

    async def endless(request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: {}\n\n")
        await seen_first.wait()
        try:
            while True:  # until the proxy hangs up, as vLLM would notice and abort
                await resp.write(b"data: {}\n\n")
                await asyncio.sleep(0.01)
        except (ConnectionError, asyncio.CancelledError):  # the test server cancels
            aborted.set()
            raise
        return resp

    async def go() -> None:
        async with cluster([Fake("p0")], [Fake("d0", endless)],
                           handler_cancellation=handler_cancellation) as client:
            async with client.post("/v1/completions", json={**COMPLETION, "stream": True}) as r:
                assert await r.content.readany()
                r.close()
            seen_first.set()
            await aborted.wait()

    run(go())


def test_prefill_4xx_passed_through() -> None:
    error = b'{"error": {"message": "model m does not exist", "code": 404}}'

    async def refuse(request: web.Request, body: dict[str, Any]) -> web.Response:
        return web.Response(status=404, body=error, content_type="application/json")

    async def go() -> None:
        d = Fake("d0")
        async with cluster([Fake("p0", refuse)], [d]) as client, \
                client.post("/v1/completions", json=COMPLETION) as r:
            assert r.status == 404
            assert await r.read() == error
            assert r.headers["Content-Type"].startswith("application/json")
            assert r.headers[FAILED_HOP] == "prefill"
        assert d.seen == []

    run(go())


@pytest.mark.parametrize("stream", [False, True])
def test_decode_5xx_passed_through(stream: bool) -> None:
    async def overloaded(request: web.Request, body: dict[str, Any]) -> web.Response:
        return web.Response(status=503, text="engine overloaded", content_type="text/plain")

    async def go() -> None:
        body = {**COMPLETION, "stream": stream}
        async with cluster([Fake("p0")], [Fake("d0", overloaded)]) as client, \
                client.post("/v1/completions", json=body) as r:
            assert r.status == 503
            assert await r.text() == "engine overloaded"
            assert r.headers["Content-Type"].startswith("text/plain")
            assert r.headers[FAILED_HOP] == "decode"

    run(go())


def test_prefill_down_is_502_naming_prefill() -> None:
    async def go() -> None:
        url = f"http://127.0.0.1:{free_port()}"
        d = Fake("d0")
        async with cluster([], [d], prefill_urls=[url]) as client, \
                client.post("/v1/completions", json=COMPLETION) as r:
            assert r.status == 502
            assert r.headers[FAILED_HOP] == "prefill"
            error = (await r.json())["error"]
            assert error["hop"] == "prefill"
            assert error["url"] == url + "/v1/completions"
            assert "prefill" in error["message"] and url in error["message"]
        assert d.seen == []

    run(go())


def test_decode_timeout_is_502_naming_decode() -> None:
    release = asyncio.Event()

    async def stuck(request: web.Request, body: dict[str, Any]) -> web.Response:
        await release.wait()
        return web.json_response({})

    async def go() -> None:
        async with cluster([Fake("p0")], [Fake("d0", stuck)], timeout=0.3) as client:
            async with client.post("/v1/completions", json=COMPLETION) as r:
                assert r.status == 502
                assert r.headers[FAILED_HOP] == "decode"
                error = (await r.json())["error"]
                assert error["hop"] == "decode"
                assert "within 0.3 s" in error["message"]
            release.set()

    run(go())


def test_prefill_without_kv_transfer_params_is_502() -> None:
    async def plain(request: web.Request, body: dict[str, Any]) -> web.Response:
        return web.json_response({"id": "cmpl-p", "choices": [{"text": "x"}]})

    async def go() -> None:
        d = Fake("d0")
        async with cluster([Fake("p0", plain)], [d]) as client, \
                client.post("/v1/completions", json=COMPLETION) as r:
            assert r.status == 502
            error = (await r.json())["error"]
            assert error["hop"] == "prefill"
            assert "kv_transfer_params" in error["message"]
            assert "kv_producer" in error["message"]
        assert d.seen == []

    run(go())


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe"])
def test_malformed_body_is_400(raw: bytes) -> None:
    async def go() -> None:
        p, d = Fake("p0"), Fake("d0")
        async with cluster([p], [d]) as client, \
                client.post("/v1/chat/completions", data=raw,
                            headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == 400
            assert FAILED_HOP not in r.headers
        assert p.seen == d.seen == []

    run(go())


def test_oversized_body_is_413() -> None:
    async def go() -> None:
        p = Fake("p0")
        async with cluster([p], [Fake("d0")], max_body_bytes=1024) as client, \
                client.post("/v1/completions", json={**COMPLETION, "prompt": "x" * 4096}) as r:
            assert r.status == 413
            assert "1024" in (await r.json())["error"]["message"]
        assert p.seen == []

    run(go())


def test_round_robin() -> None:
    async def go() -> None:
        prefill, decode = [Fake("p0"), Fake("p1")], [Fake("d0"), Fake("d1")]
        served = []
        async with cluster(prefill, decode) as client:
            for _ in range(4):
                async with client.post("/v1/completions", json=COMPLETION) as r:
                    assert r.status == 200
                    served.append((await r.json())["served_by"])
        assert served == ["d0", "d1", "d0", "d1"]
        assert [len(f.seen) for f in prefill + decode] == [2, 2, 2, 2]
        # Each decode hop carries the kv_transfer_params of the prefill that ran it.
        for i in range(2):
            for seen in decode[i].seen:
                assert seen.body["kv_transfer_params"] == prefill[i].params()

    run(go())


def test_health_and_models() -> None:
    async def go() -> None:
        async with cluster([Fake("p0")], [Fake("d0"), Fake("d1")]) as client:
            async with client.get("/health") as r:
                assert r.status == 200
                assert (await r.json())["status"] == "ok"
            for _ in range(2):  # always the first decode
                async with client.get("/v1/models") as r:
                    assert r.status == 200
                    assert (await r.json())["data"] == [{"id": "d0"}]
            async with client.get("/v1/nothing") as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == 404

    run(go())


def test_bad_configuration() -> None:
    with pytest.raises(ValueError, match="at least one prefill"):
        make_app([], ["http://127.0.0.1:1"])
    with pytest.raises(ValueError, match="http://"):
        make_app(["127.0.0.1:1"], ["http://127.0.0.1:1"])
    assert cli_main(["vllm-proxy", "--prefill", "localhost:8100",
                     "--decode", "http://127.0.0.1:8200"]) == 2


def test_prefill_body_leaves_the_original_alone() -> None:
    body = {**COMPLETION, "stream": True, "stream_options": {"include_usage": True}}
    before = json.dumps(body)
    out = prefill_body(body)
    assert json.dumps(body) == before
    assert out["stream"] is False and "stream_options" not in out
