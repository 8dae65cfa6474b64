"""The connector's worker half: one kvhandoff :class:`~kvhandoff.session.agent.Agent` per
vLLM worker, a :class:`~kvhandoff.session.sender.Sender` per request leaving prefill and a
:class:`~kvhandoff.session.receiver.Receiver` per request arriving on decode.

vLLM calls in on its step thread; the agent's own threads move the bytes. ``finished``
(vLLM's ``get_finished``) polls the live requests and reports:

* prefill: a request once its Sender is final *and settled* (no write still reads its
  blocks), whatever the outcome: vLLM may then free the blocks;
* decode: a request once its Receiver succeeded, or failed *and released* (no late write
  can land in its blocks). A failure also reports the request's blocks through
  ``load_errors`` so vLLM's ``kv_load_failure_policy`` applies: tokens from a failed
  handoff are never served as a success.

Each request leases an aux row (the 16-byte arrival guard decode checks before it says
SUCCESS) from a small pool for its lifetime.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhandoff.integrations.vllm.requests import RecvReq, SendReq, StepMeta
from kvhandoff.layout import Layout
from kvhandoff.session.agent import Agent
from kvhandoff.session.aux import AuxSpec
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.errors import HandshakeError
from kvhandoff.session.memory import host_view
from kvhandoff.session.receiver import Receiver
from kvhandoff.session.sender import Sender
from kvhandoff.session.status import Status

log = logging.getLogger("kvhandoff.integrations.vllm")

AUX = AuxSpec()
AUX_NAME = "aux"


class AuxRows:
    """A fixed pool of aux rows; a request holds one from start to finish."""

    def __init__(self, n: int) -> None:
        self.buffer, self.component = AUX.allocate(n, name=AUX_NAME)
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, row: int) -> None:
        self._free.append(row)


@dataclass(slots=True)
class Stats:
    """What this worker moved since the last report (vLLM's connector stats)."""

    sent: int = 0
    received: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    bytes_received: int = 0
    transfer_s: list[float] = field(default_factory=list)

    def fail(self, reason: str) -> None:
        self.failed[reason] = self.failed.get(reason, 0) + 1


@dataclass(slots=True)
class _Out:
    sender: Sender
    row: int


@dataclass(slots=True)
class _In:
    receiver: Receiver | None  # None: failed before a Receiver existed
    row: int | None
    blocks: frozenset[int]
    lists: tuple[tuple[int, ...], ...]
    nbytes: int
    started: float
    aborted: bool = False  # decode's vLLM request ended: report it as a finished send


def _reason(err: object) -> str:
    return type(err).__name__ if err is not None else "unknown"


class WorkerSide:
    """See the module docstring."""

    def __init__(self, layout: Layout, rows: AuxRows, *, producer: bool, bootstrap: str,
                 config: SessionConfig, kv_name: str | None) -> None:
        self.producer = producer
        self.layout = layout
        self.rows = rows
        self.kv_name = kv_name
        self.stats = Stats()
        self._lock = threading.Lock()
        self._out: dict[str, _Out] = {}
        self._in: dict[str, _In] = {}
        self._errors: set[int] = set()
        self.names = [c.name for c in layout.components if c.name != AUX_NAME]
        if producer:
            self.agent = Agent.prefill(layout, bootstrap_url=bootstrap, config=config)
        else:
            self.agent = Agent.decode(layout, config=config)
            self._check_pair(bootstrap)

    def _check_pair(self, bootstrap: str) -> None:
        """Decode: handshake prefill now, so an incompatible pair stops vLLM at start-up
        (the message names every field that differs). A prefill that is not up yet is
        handshaken on the first request instead."""
        why = self.agent.handshake(bootstrap)
        if isinstance(why, HandshakeError):
            self.agent.close()
            raise HandshakeError(f"kvhandoff refuses this prefill/decode pair: {why}")
        if why is not None:
            log.warning("kvhandoff: no prefill handshaken at start-up (%s); the first "
                        "request will try again", why)

    # --- per step --------------------------------------------------------------------

    def start(self, meta: StepMeta) -> None:
        for s in meta.sends:
            self._send(s)
        for r in meta.recvs:
            self._receive(r)
        for rid in meta.aborts:
            entry = self._in.get(rid)
            if entry is not None:
                entry.aborted = True
                if entry.receiver is not None:
                    entry.receiver.abort("vLLM ended the request on decode")

    def _send(self, s: SendReq) -> None:
        row = self.rows.take()
        sender = Sender(self.agent, s.request_id)
        if row is None:
            sender.abort("no free aux row on prefill (too many handoffs in flight)")
            self.stats.fail("no_aux_row")
            self._out[s.request_id] = _Out(sender, -1)
            return
        self._out[s.request_id] = _Out(sender, row)
        kv_pages: tuple[int, ...] = ()
        state: dict[str, object | None] = {}
        for name, blocks in zip(self.names, s.blocks, strict=True):
            if name == self.kv_name:
                kv_pages = blocks
            else:
                state[name] = list(blocks)
        self.rows.buffer[row * AUX.row_bytes:(row + 1) * AUX.row_bytes] = 0
        self._dump("prefill", s.request_id, s.blocks)
        sender.init(len(kv_pages), row, num_tokens=s.num_tokens)
        sender.send(list(kv_pages), state, last=True)

    def _receive(self, r: RecvReq) -> None:
        blocks = frozenset(b for g in r.blocks for b in g)
        nbytes = sum(len(g) * sum(t.item_bytes for t in c.tensors)
                     for g, c in zip(r.blocks, self.layout.components, strict=False))
        row = self.rows.take()
        entry = _In(None, row, blocks, r.blocks, nbytes, time.monotonic())
        self._in[r.request_id] = entry
        if row is None:
            log.error("request %s: no free aux row on decode; failing its load", r.request_id)
            self.stats.fail("no_aux_row")
            return
        rec = Receiver(self.agent, r.bootstrap, r.remote_id, instance=r.instance)
        entry.receiver = rec
        indices: dict[str, object | None] = {
            name: list(blocks) for name, blocks in zip(self.names, r.blocks, strict=True)}
        rec.init(indices, row, decode_prefix_len=r.prefix_tokens)

    def finished(self) -> tuple[set[str], set[str]]:
        """(finished sends, finished receives) since the last call."""
        sending: set[str] = set()
        recving: set[str] = set()
        for rid, o in list(self._out.items()):
            st = o.sender.poll()
            if st in (Status.SUCCESS, Status.FAILED) and o.sender.settled:
                del self._out[rid]
                if o.row >= 0:
                    self.rows.give(o.row)
                sending.add(rid)
                if st is Status.SUCCESS:
                    self.stats.sent += 1
                else:
                    self.stats.fail(_reason(o.sender.error))
                    log.warning("request %s: handoff failed on prefill: %s", rid,
                                o.sender.reason)
        for rid, e in list(self._in.items()):
            rec = e.receiver
            st = rec.poll() if rec is not None else Status.FAILED
            if st is Status.SUCCESS:
                self._dump("decode", rec.request_id if rec else rid, e.lists,
                           ms=1e3 * (time.monotonic() - e.started))
                self.stats.received += 1
                self.stats.bytes_received += e.nbytes
                self.stats.transfer_s.append(time.monotonic() - e.started)
            elif st is Status.FAILED and (rec is None or rec.released):
                if rec is not None:
                    self.stats.fail(_reason(rec.error))
                    log.warning("request %s: handoff failed on decode: %s", rid, rec.reason)
                self._errors.update(e.blocks)
            else:
                continue
            del self._in[rid]
            if e.row is not None:
                self.rows.give(e.row)
            (sending if e.aborted else recving).add(rid)
        return sending, recving

    def _dump(self, side: str, rid: object, lists: tuple[tuple[int, ...], ...],
              ms: float | None = None) -> None:
        """With ``KVHANDOFF_VLLM_DUMP=FILE``, append per component a digest of its moving
        blocks (tests compare prefill's with decode's, byte for byte) and their bytes;
        decode adds the handoff's milliseconds (Receiver opened → SUCCESS)."""
        path = os.environ.get("KVHANDOFF_VLLM_DUMP")
        if not path:
            return
        rows = []
        for name, blocks in zip(self.names, lists, strict=True):
            data = block_bytes(self.layout, name, list(blocks))
            rows.append({"side": side, "request": str(rid), "component": name,
                         "blocks": len(blocks), "bytes": len(data), "ms": ms,
                         "sha256": hashlib.sha256(data.tobytes()).hexdigest()})
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))

    def load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def busy(self) -> bool:
        return bool(self._out or self._in)

    def close(self) -> None:
        for o in self._out.values():
            o.sender.abort("vLLM worker shutting down")
        for e in self._in.values():
            if e.receiver is not None:
                e.receiver.abort("vLLM worker shutting down")
        self.agent.close()


def block_bytes(layout: Layout, name: str, blocks: list[int]) -> np.ndarray[Any, Any]:
    """``blocks`` of every tensor of component ``name``, concatenated (for comparisons)."""
    c = layout.component(name)
    parts = [host_view(t.ptr + b * t.item_bytes, t.item_bytes) for t in c.tensors for b in blocks]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)
