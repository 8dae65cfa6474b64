"""A disaggregated prefill/decode proxy for vLLM OpenAI servers (``kvhandoff vllm-proxy``).

Each ``POST /v1/completions`` or ``POST /v1/chat/completions`` visits two servers in turn:

1. **prefill** (round robin over the prefill URLs) gets the client's body with
   ``max_tokens`` 1 (and ``max_completion_tokens`` 1 when present), ``stream`` false, no
   ``stream_options`` or ``min_tokens``, and ``kv_transfer_params`` asking for a remote
   decode. Its JSON answer carries ``kv_transfer_params``: where its KV blocks wait.
2. **decode** (round robin over the decode URLs) gets the client's original body plus those
   ``kv_transfer_params``, pulls the KV cache and generates.

The decode answer goes back to the client: passed through chunk by chunk (SSE) when the
client asked for ``"stream": true``, else as one JSON body with ``X-Kvhandoff-Prefill-Ms``
and ``X-Kvhandoff-Decode-Ms`` (the wall time of each hop; a stream carries the prefill one).
Both hops carry the same ``X-Request-Id`` (the client's, or a fresh uuid4), which is also
echoed to the client, and the client's ``Authorization``.

Failures name the hop. An upstream non-2xx answer is passed through unchanged (status,
body, content type) with ``X-Kvhandoff-Failed-Hop: prefill|decode``. An unreachable or
timed-out server, an oversized or non-JSON answer, or a prefill answer without
``kv_transfer_params`` is a 502 whose OpenAI-style JSON error names the hop and URL. A
malformed client body is a 400, an oversized one a 413. A decode stream that breaks after
its first byte cannot change its status any more: the proxy cuts the client's connection,
so the client sees a truncated stream rather than a clean end.

``GET /health`` answers while the proxy runs (it does not probe the servers);
``GET /v1/models`` is forwarded to the first decode URL.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import aiohttp
from aiohttp import hdrs, web

from kvhandoff.signals import stop_on_signals

__all__ = [
    "DECODE_MS",
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_CONNECTIONS",
    "DEFAULT_TIMEOUT",
    "FAILED_HOP",
    "PREFILL_MS",
    "make_app",
    "prefill_body",
    "serve",
]

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT: Final = 600.0
"""Seconds one hop may take in total (connect, send, the whole answer or stream)."""
DEFAULT_MAX_BODY_BYTES: Final = 64 * 2**20
"""Largest client body accepted (413 beyond) and largest buffered upstream answer."""
DEFAULT_MAX_CONNECTIONS: Final = 1024
"""Open upstream connections at most; one in-flight request holds one at a time."""

FAILED_HOP: Final = "X-Kvhandoff-Failed-Hop"
PREFILL_MS: Final = "X-Kvhandoff-Prefill-Ms"
DECODE_MS: Final = "X-Kvhandoff-Decode-Ms"
REQUEST_ID: Final = "X-Request-Id"

ROUTES: Final = ("/v1/completions", "/v1/chat/completions")


def _remote_decode_params() -> dict[str, Any]:
    """The ``kv_transfer_params`` of a prefill hop (vLLM's P/D connector protocol)."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill hop's body: the client's, computing the prompt and one token only.

    ``min_tokens`` is dropped too: vLLM refuses ``min_tokens > max_tokens``.
    """
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out.pop("min_tokens", None)
    out["kv_transfer_params"] = _remote_decode_params()
    return out


class _Backends:
    """One role's server URLs, handed out round robin (single event loop: no lock)."""

    def __init__(self, role: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"vllm-proxy needs at least one {role} URL")
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{role} URL {url!r} must start with http:// or https://")
        self.role = role
        self.urls = [u.rstrip("/") for u in urls]
        self._cycle = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._cycle)


@dataclass
class _Proxy:
    prefill: _Backends
    decode: _Backends
    timeout: float
    max_body_bytes: int
    max_connections: int
    session: aiohttp.ClientSession | None = None

    def client(self) -> aiohttp.ClientSession:
        if self.session is None:
            raise RuntimeError("vllm-proxy client session used outside the app's lifetime")
        return self.session


PROXY: Final = web.AppKey("kvhandoff_vllm_proxy", _Proxy)


class _Refused(Exception):
    """Answer the client with an OpenAI-style JSON error (the proxy's own, not passed
    through)."""

    def __init__(self, status: int, message: str, *, hop: str | None = None,
                 url: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.hop, self.url = status, message, hop, url


def _hop_failed(hop: str, url: str, reason: str) -> _Refused:
    return _Refused(502, f"{hop} hop to {url} failed: {reason}", hop=hop, url=url)


def _error_response(err: _Refused, request_id: str | None) -> web.Response:
    error: dict[str, Any] = {"message": err.message, "type": "kvhandoff_proxy_error",
                             "param": None, "code": err.status}
    headers: dict[str, str] = {}
    if err.hop is not None:
        error["hop"], error["url"] = err.hop, err.url
        headers[FAILED_HOP] = err.hop
    if request_id is not None:
        headers[REQUEST_ID] = request_id
    return web.json_response({"error": error}, status=err.status, headers=headers)


@web.middleware
async def _errors(request: web.Request,
                  handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                  ) -> web.StreamResponse:
    """The router's 404/405 become JSON errors; a bug of ours is logged and answered 500,
    never a dropped connection. (Handlers answer their own refusals, with the request id.)
    """
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _error_response(_Refused(e.status, f"{e.reason}: {request.method} "
                                                  f"{request.path}"), None)
    except Exception:
        log.exception("vllm-proxy handler failed on %s %s", request.method, request.path)
        return _error_response(_Refused(500, "internal proxy error"), None)


def _request_id(request: web.Request) -> str:
    return request.headers.get(REQUEST_ID) or str(uuid.uuid4())


def _describe(e: BaseException, timeout: float) -> str:
    if isinstance(e, TimeoutError):
        return f"no complete answer within {timeout:g} s (vllm-proxy --timeout)"
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect ({e.os_error or e})"
    return f"{type(e).__name__}: {e}"


def _upstream_headers(request: web.Request, request_id: str) -> dict[str, str]:
    headers = {REQUEST_ID: request_id, hdrs.CONTENT_TYPE: "application/json"}
    auth = request.headers.get(hdrs.AUTHORIZATION)
    if auth is not None:
        headers[hdrs.AUTHORIZATION] = auth
    return headers


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int, hop: str, url: str
                        ) -> bytes:
    data = bytearray()
    async for chunk in resp.content.iter_any():
        data += chunk
        if len(data) > limit:
            raise _hop_failed(hop, url, f"answer larger than {limit} bytes "
                                        "(vllm-proxy --max-body-bytes)")
    return bytes(data)


@dataclass(frozen=True)
class _Answer:
    status: int
    content_type: str
    body: bytes
    ms: float

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300


async def _call(proxy: _Proxy, hop: str, method: str, url: str, headers: dict[str, str],
                body: dict[str, Any] | None = None) -> _Answer:
    """One hop, answer read whole (bounded); transport failures become a 502."""
    t0 = time.perf_counter()
    data = None if body is None else json.dumps(body).encode()
    try:
        async with proxy.client().request(method, url, data=data, headers=headers) as resp:
            raw = await _read_bounded(resp, proxy.max_body_bytes, hop, url)
            ctype = resp.headers.get(hdrs.CONTENT_TYPE, "application/octet-stream")
            return _Answer(resp.status, ctype, raw, (time.perf_counter() - t0) * 1e3)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise _hop_failed(hop, url, _describe(e, proxy.timeout)) from e


def _passthrough(answer: _Answer, request_id: str, extra: dict[str, str],
                 failed_hop: str | None = None) -> web.Response:
    headers = {hdrs.CONTENT_TYPE: answer.content_type, REQUEST_ID: request_id, **extra}
    if failed_hop is not None:
        headers[FAILED_HOP] = failed_hop
    return web.Response(status=answer.status, body=answer.body, headers=headers)


def _kv_transfer_params(answer: _Answer, url: str) -> dict[str, Any]:
    try:
        doc = json.loads(answer.body)
    except ValueError as e:
        raise _hop_failed("prefill", url, f"answer is not JSON ({e})") from e
    params = doc.get("kv_transfer_params") if isinstance(doc, dict) else None
    if not isinstance(params, dict):
        raise _hop_failed("prefill", url, "answer has no kv_transfer_params object; is the "
                                          "prefill server started with a kv_producer (or "
                                          "kv_both) --kv-transfer-config?")
    return params


async def _client_body(request: web.Request) -> dict[str, Any]:
    try:
        raw = await request.read()  # bounded by client_max_size
    except web.HTTPRequestEntityTooLarge as e:
        limit = request.app[PROXY].max_body_bytes
        raise _Refused(413, f"request body larger than {limit} bytes "
                            "(vllm-proxy --max-body-bytes)") from e
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise _Refused(400, f"request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise _Refused(400, f"request body must be a JSON object, got {type(body).__name__}")
    return body


def _ms(value: float) -> str:
    return f"{value:.1f}"


async def _completions(request: web.Request) -> web.StreamResponse:
    request_id = _request_id(request)
    try:
        return await _handoff(request, request_id)
    except _Refused as e:
        return _error_response(e, request_id)


async def _handoff(request: web.Request, request_id: str) -> web.StreamResponse:
    proxy = request.app[PROXY]
    body = await _client_body(request)
    headers = _upstream_headers(request, request_id)

    prefill_url = proxy.prefill.pick() + request.path
    pre = await _call(proxy, "prefill", "POST", prefill_url, headers, prefill_body(body))
    timing = {PREFILL_MS: _ms(pre.ms)}
    if not pre.ok:
        return _passthrough(pre, request_id, timing, failed_hop="prefill")
    decode_body = {**body, "kv_transfer_params": _kv_transfer_params(pre, prefill_url)}

    decode_url = proxy.decode.pick() + request.path
    if body.get("stream") is True:
        return await _stream(request, proxy, decode_url, headers, decode_body, timing)
    dec = await _call(proxy, "decode", "POST", decode_url, headers, decode_body)
    timing[DECODE_MS] = _ms(dec.ms)
    return _passthrough(dec, request_id, timing, failed_hop=None if dec.ok else "decode")


async def _stream(request: web.Request, proxy: _Proxy, url: str, headers: dict[str, str],
                  body: dict[str, Any], timing: dict[str, str]) -> web.StreamResponse:
    """The decode hop of a streaming request: its bytes are written on as they arrive."""
    request_id = headers[REQUEST_ID]
    t0 = time.perf_counter()
    try:
        resp = await proxy.client().post(url, data=json.dumps(body).encode(), headers=headers)
    except (aiohttp.ClientError, TimeoutError) as e:
        raise _hop_failed("decode", url, _describe(e, proxy.timeout)) from e
    async with resp:
        if not 200 <= resp.status < 300:
            try:
                raw = await _read_bounded(resp, proxy.max_body_bytes, "decode", url)
            except (aiohttp.ClientError, TimeoutError) as e:
                raise _hop_failed("decode", url, _describe(e, proxy.timeout)) from e
            ctype = resp.headers.get(hdrs.CONTENT_TYPE, "application/octet-stream")
            answer = _Answer(resp.status, ctype, raw, (time.perf_counter() - t0) * 1e3)
            return _passthrough(answer, request_id, timing, failed_hop="decode")
        out = web.StreamResponse(status=resp.status, headers={
            hdrs.CONTENT_TYPE: resp.headers.get(hdrs.CONTENT_TYPE, "text/event-stream"),
            hdrs.CACHE_CONTROL: "no-cache", REQUEST_ID: request_id, **timing})
        await out.prepare(request)
        while True:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientError, TimeoutError) as e:
                log.warning("request %s: decode stream from %s broke: %s; cutting the "
                            "client's stream", request_id, url, _describe(e, proxy.timeout))
                resp.close()
                if request.transport is not None:
                    request.transport.close()  # the client sees a truncated stream
                return out
            if not chunk:
                break
            try:
                await out.write(chunk)
            except ConnectionError:  # the client went away: drop the decode connection,
                resp.close()         # which makes vLLM abort the request
                log.info("request %s: client disconnected mid-stream", request_id)
                return out
        await out.write_eof()
        return out


async def _models(request: web.Request) -> web.StreamResponse:
    proxy = request.app[PROXY]
    request_id = _request_id(request)
    headers = _upstream_headers(request, request_id)
    del headers[hdrs.CONTENT_TYPE]
    try:
        answer = await _call(proxy, "decode", "GET", proxy.decode.urls[0] + "/v1/models",
                             headers)
    except _Refused as e:
        return _error_response(e, request_id)
    return _passthrough(answer, request_id, {}, failed_hop=None if answer.ok else "decode")


async def _health(request: web.Request) -> web.Response:
    proxy = request.app[PROXY]
    return web.json_response({"status": "ok", "prefill": proxy.prefill.urls,
                              "decode": proxy.decode.urls})


def make_app(prefill: list[str], decode: list[str], *, timeout: float = DEFAULT_TIMEOUT,
             max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
             max_connections: int = DEFAULT_MAX_CONNECTIONS) -> web.Application:
    """The proxy as an aiohttp application (run it with ``web.AppRunner`` or :func:`serve`).

    ``timeout`` bounds each hop in total (for a stream: its whole length);
    ``max_body_bytes`` bounds the client's body and every buffered upstream answer;
    ``max_connections`` bounds the open upstream connections. One ``ClientSession`` lives
    as long as the app runs. Raises ``ValueError`` on an empty URL list or a bad bound.
    """
    if not timeout > 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if max_body_bytes < 1 or max_connections < 1:
        raise ValueError(f"max_body_bytes ({max_body_bytes}) and max_connections "
                         f"({max_connections}) must be positive")
    proxy = _Proxy(_Backends("prefill", prefill), _Backends("decode", decode), timeout,
                   max_body_bytes, max_connections)
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors])
    app[PROXY] = proxy

    async def client_session(app: web.Application) -> AsyncIterator[None]:
        proxy.session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout),
            connector=aiohttp.TCPConnector(limit=max_connections))
        try:
            yield
        finally:
            session, proxy.session = proxy.session, None
            await session.close()

    app.cleanup_ctx.append(client_session)
    for path in ROUTES:
        app.router.add_post(path, _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    return app


def _url(host: str, port: int) -> str:
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def serve(prefill: list[str], decode: list[str], *, host: str = "127.0.0.1", port: int = 8000,
          timeout: float = DEFAULT_TIMEOUT, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          max_connections: int = DEFAULT_MAX_CONNECTIONS,
          announce: Callable[[str], None] | None = None) -> int:
    """Run the proxy in the foreground until SIGINT or SIGTERM; return 0.

    For ``kvhandoff vllm-proxy``. ``announce`` receives one line with the bound URL once
    the socket listens (by default printed and flushed, so a launcher can read the port).
    """
    say = announce or (lambda line: print(line, flush=True))
    try:
        app = make_app(prefill, decode, timeout=timeout, max_body_bytes=max_body_bytes,
                       max_connections=max_connections)
    except ValueError as e:
        print(f"kvhandoff vllm-proxy: error: {e}", file=sys.stderr)
        return 2

    async def main() -> None:
        stop = stop_on_signals()
        # handler_cancellation: a client that hangs up cancels its handler, which closes
        # the upstream connection, so vLLM aborts the request (prefill or decode).
        runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=2.0)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            bound = int(runner.addresses[0][1])
            say(f"kvhandoff vllm-proxy listening on {_url(host, bound)} "
                f"(prefill: {', '.join(app[PROXY].prefill.urls)}; "
                f"decode: {', '.join(app[PROXY].decode.urls)})")
            await stop.wait()
        finally:
            await runner.cleanup()

    try:
        asyncio.run(main())
    except OSError as e:  # the address is taken or cannot be bound
        print(f"kvhandoff vllm-proxy: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    return 0
