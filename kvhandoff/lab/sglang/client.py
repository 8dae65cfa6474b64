"""Requests to SGLang servers and routers: one tokenised greedy ``/generate`` (stdlib only).

:func:`generate` waits for the whole answer; :func:`stream` reads SGLang's server-sent
events and also times the first token as the client sees it (TTFT: request sent →
first chunk carrying an output token), which through a PD router includes prefill,
the KV transfer and decode's first step.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.lab.servers import post_json
from kvhandoff.lab.sglang.serve import BootstrapAddr

__all__ = ["REQUEST_TIMEOUT_S", "Answer", "abort", "generate", "request_body", "stream"]

REQUEST_TIMEOUT_S = 300.0


def request_body(input_ids: Sequence[int], *, max_new_tokens: int,
                 bootstrap: BootstrapAddr | None = None, stream: bool = False,
                 rid: str | None = None) -> dict[str, Any]:
    """A greedy ``/generate`` body that always produces ``max_new_tokens`` tokens (EOS
    ignored). ``bootstrap`` routes it through a prefill server's room (send it to
    prefill and decode alike); a router adds that itself. ``rid`` names the request
    (what ``/abort_request`` takes); SGLang picks one otherwise."""
    return {"input_ids": list(input_ids), "stream": stream,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0,
                                "ignore_eos": True},
            **(bootstrap.fields() if bootstrap else {}), **({"rid": rid} if rid else {})}


def generate(url: str, input_ids: Sequence[int], *, max_new_tokens: int,
             bootstrap: BootstrapAddr | None = None, rid: str | None = None,
             timeout: float = REQUEST_TIMEOUT_S) -> dict[str, Any]:
    """POST one request to ``url`` (a server or a router) and return SGLang's answer
    (``output_ids``, ``meta_info``)."""
    out = post_json(url.rstrip("/") + "/generate",
                    request_body(input_ids, max_new_tokens=max_new_tokens, bootstrap=bootstrap,
                                 rid=rid),
                    timeout=timeout)
    if not isinstance(out, dict) or "output_ids" not in out:
        raise ValueError(f"{url}/generate answered without output_ids: {str(out)[:500]}")
    return out


def abort(url: str, rid: str, *, timeout: float = 30.0) -> None:
    """Ask the SGLang server at ``url`` to abort request ``rid`` (``/abort_request``, as
    its HTTP front does when a client disconnects); SGLang answers 200 whether or not it
    knows the request."""
    req = urllib.request.Request(url.rstrip("/") + "/abort_request",
                                 data=json.dumps({"rid": rid}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()


@dataclass(frozen=True, slots=True)
class Answer:
    """One streamed request: its tokens, SGLang's last ``meta_info``, and the client's
    clock (seconds from sending to the first token, and to the end)."""

    output_ids: tuple[int, ...]
    meta: Mapping[str, Any]
    ttft_s: float
    total_s: float


def stream(url: str, input_ids: Sequence[int], *, max_new_tokens: int,
           timeout: float = REQUEST_TIMEOUT_S) -> Answer:
    """POST one streaming request and read it to the end. SGLang streams cumulative
    ``output_ids`` (``--incremental-streaming-output`` is off), so the last event holds
    them all."""
    body = json.dumps(request_body(input_ids, max_new_tokens=max_new_tokens, stream=True))
    req = urllib.request.Request(url.rstrip("/") + "/generate", data=body.encode(),
                                 method="POST", headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first: float | None = None
    last: dict[str, Any] = {}
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for raw in resp:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line[5:])
            if not isinstance(event, dict) or "output_ids" not in event:
                raise ValueError(f"{url}/generate streamed an event without output_ids: "
                                 f"{line[:500]}")
            if first is None and event["output_ids"]:
                first = time.perf_counter()
            last = event
    end = time.perf_counter()
    if first is None:
        raise ValueError(f"{url}/generate streamed no token for a {len(input_ids)}-token prompt")
    ids = tuple(int(t) for t in last["output_ids"])
    meta = last.get("meta_info", {})
    if len(ids) != meta.get("completion_tokens"):
        raise ValueError(f"{url}/generate: the last event has {len(ids)} output ids but "
                         f"{meta.get('completion_tokens')} completion tokens (incremental "
                         f"streaming output?)")
    return Answer(ids, meta, first - t0, end - t0)
