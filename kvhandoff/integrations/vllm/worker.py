"""The connector's worker half: one kvhandoff :class:`~kvhandoff.session.rank.agent.Agent` per
vLLM worker, a :class:`~kvhandoff.session.request.sender.Sender` per request leaving prefill and a
:class:`~kvhandoff.session.request.receiver.Receiver` per request arriving on decode.

vLLM calls in on its step thread; the agent's own threads move the bytes. ``finished``
(vLLM's ``get_finished``) polls the live requests and reports:

* prefill: a request once its Sender is final *and settled* (no write still reads its
  blocks), whatever the outcome: vLLM may then free the blocks. The Sender gets its last
  chunk as soon as vLLM finished the request, which starts the lease
  (``SessionConfig.lease``): a request whose decode hop never comes fails
  ``LeaseExpired`` then and its blocks are freed;
* decode: a request once its Receiver succeeded, or failed *and released* (no late write
  can land in its blocks). A failure is also reported as a failed receive, so vLLM's
  ``kv_load_failure_policy`` applies (block-level errors are not an option: vLLM refuses
  them for models with several KV-cache groups): tokens from a failed handoff are never
  served as a success. A request vLLM ended while it was loading (an abort) is reported
  as a finished *send* once released, since vLLM kept its blocks for us.

Each request leases an aux row (the 16-byte arrival guard decode checks before it says
SUCCESS) from a small pool for its lifetime.

With a :class:`Staging` (vLLM's KV in GPU memory over tcp/shm, or ``host_staging``), the
layout describes a host mirror: prefill copies a request's blocks into it before its
send starts, decode copies them out of it once the receive succeeded and before vLLM
hears of it (a copy that fails fails the load). The worker owns the staging: closing
the worker closes it, after the transport.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Protocol

import numpy as np

from kvhandoff.integrations.vllm.requests import RecvReq, SendReq, StepMeta
from kvhandoff.layout import Layout, MemoryKind
from kvhandoff.memory import raw_view
from kvhandoff.observe import timeline as tl
from kvhandoff.protocol import LocalProtocolError
from kvhandoff.session.config import SessionConfig
from kvhandoff.session.errors import HandshakeError, LeaseExpired
from kvhandoff.session.rank.agent import Agent
from kvhandoff.session.request.aux import AuxSpec
from kvhandoff.session.request.receiver import Receiver
from kvhandoff.session.request.sender import Sender
from kvhandoff.session.request.status import Status
from kvhandoff.transport.base import Transport

log = logging.getLogger("kvhandoff.integrations.vllm")

AUX = AuxSpec()
AUX_NAME = "aux"


class Staging(Protocol):
    """Moves a request's blocks (one list per group) between vLLM's tensors and the
    memory the layout describes (:class:`~.host_staging.HostStaging`)."""

    def to_host(self, blocks: Sequence[Sequence[int]]) -> None: ...

    def to_device(self, blocks: Sequence[Sequence[int]]) -> None: ...

    def close(self) -> None: ...


class AuxRows:
    """A fixed pool of aux rows; a request holds one from start to finish. ``allocate``
    supplies the buffer (a transport's, where peers may write only there)."""

    def __init__(self, n: int, allocate: Callable[[int], np.ndarray[Any, Any]] | None = None
                 ) -> None:
        if allocate is None:
            self.buffer, self.component = AUX.allocate(n, name=AUX_NAME)
        else:
            self.buffer = allocate(n * AUX.row_bytes)
            self.component = AUX.component(ptr=int(self.buffer.ctypes.data), num_rows=n,
                                           name=AUX_NAME)
        self._free = list(range(n - 1, -1, -1))

    def take(self) -> int | None:
        return self._free.pop() if self._free else None

    def give(self, row: int) -> None:
        self._free.append(row)


STAT_KEYS = ("handoff_seconds", "phase_seconds", "bytes", "group_bytes", "outcomes")

class Stats:
    """Observations since the last report, as vLLM's connector stats want them: a dict of
    lists (it pickles them from the worker to the process that exports metrics).

    ``handoff_seconds``: per successful handoff ``[role, seconds]``, opened to settled
    (prefill) or landed (decode); ``phase_seconds``: ``[role, phase, seconds]`` for the
    phases in :data:`kvhandoff.observe.timeline.PHASES`, taken from the request's
    timeline (when each event happened, not when a step polled it); ``bytes`` and
    ``group_bytes``: what a successful handoff moved (``[role, n]``, ``[role, component,
    n]``); ``outcomes``: ``[role, "success" or the error class]``."""

    def __init__(self) -> None:
        self.data: dict[str, list[list[object]]] = {k: [] for k in STAT_KEYS}

    def take(self) -> dict[str, list[list[object]]]:
        out, self.data = self.data, {k: [] for k in STAT_KEYS}
        return out

    def empty(self) -> bool:
        return not any(self.data.values())

    def outcome(self, role: str, what: str) -> None:
        self.data["outcomes"].append([role, what])

    def phases(self, role: str, timeline: tl.Timeline, groups: dict[str, int]) -> None:
        total = timeline.span(tl.OPENED, tl.END[role])
        if total is not None:
            self.data["handoff_seconds"].append([role, total])
        for phase, s in tl.phase_seconds(role, timeline).items():
            self.data["phase_seconds"].append([role, phase, s])
        self.data["bytes"].append([role, sum(groups.values())])
        self.data["group_bytes"].extend([role, g, n] for g, n in groups.items())


@dataclass(slots=True)
class _Out:
    sender: Sender
    row: int | None
    groups: dict[str, int]  # bytes per component this request moves


@dataclass(slots=True)
class _In:
    receiver: Receiver | None  # None: failed before a Receiver existed
    row: int | None
    lists: tuple[tuple[int, ...], ...]
    groups: dict[str, int]
    aborted: bool = False  # decode's vLLM request ended: report it as a finished send


def _reason(err: object) -> str:
    return type(err).__name__ if err is not None else "unknown"


class WorkerSide:
    """See the module docstring. Called from vLLM's step thread only."""

    def __init__(self, layout: Layout, rows: AuxRows, *, producer: bool, bootstrap: str,
                 config: SessionConfig, kv_name: str | None,
                 staging: Staging | None = None, transport: Transport | None = None
                 ) -> None:
        self.producer = producer
        self.staging = staging
        self.role = "prefill" if producer else "decode"
        self.layout = layout
        self.rows = rows
        self.kv_name = kv_name
        self.stats = Stats()
        self._out: dict[str, _Out] = {}
        self._in: dict[str, _In] = {}
        self.names = [c.name for c in layout.components if c.name != AUX_NAME]
        self._item_bytes = {c.name: sum(t.item_bytes for t in c.tensors)
                            for c in layout.components}
        if producer:
            self.agent = Agent.prefill(layout, bootstrap_url=bootstrap, config=config,
                                       transport=transport)
        else:
            self.agent = Agent.decode(layout, config=config, transport=transport)
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

    def _groups(self, lists: tuple[tuple[int, ...], ...]) -> dict[str, int]:
        return {n: len(b) * self._item_bytes[n] for n, b in zip(self.names, lists, strict=True)}

    # --- per step --------------------------------------------------------------------

    def start(self, meta: StepMeta) -> None:
        """Open this step's handoffs. One that cannot start fails alone (its blocks are
        reported like any failure's); it never takes vLLM's engine down. The step's
        handovers go out together (``Agent.batched_writes``): on prefill the writes of
        sends whose decode indices are already in, one submit per decode rank; on decode
        the loads' indices, one message per prefill rank."""
        try:
            with self.agent.batched_writes():
                self._start(meta)
        except LocalProtocolError:  # a message that cannot be encoded: a bug, not vLLM's
            log.exception("kvhandoff: a control message of this step could not be sent; "
                          "its requests fail by their timeouts")

    def _start(self, meta: StepMeta) -> None:
        for s in meta.sends:
            try:
                self._send(s)
            except Exception as e:  # a bad request must not kill the engine loop
                log.exception("request %s: cannot start its handoff", s.request_id)
                out = self._out.get(s.request_id)
                if out is not None:
                    out.sender.abort(f"could not start: {e}")
        for r in meta.recvs:
            try:
                self._receive(r)
            except Exception as e:
                log.exception("request %s: cannot start its load", r.request_id)
                failed = self._in.setdefault(r.request_id, _In(None, None, r.blocks, {}))
                if failed.receiver is not None:
                    failed.receiver.abort(f"could not start: {e}")
        for rid in meta.aborts:
            entry = self._in.get(rid)
            if entry is None:  # already reported: vLLM frees it on that report
                continue
            entry.aborted = True
            if entry.receiver is not None:
                entry.receiver.abort("vLLM ended the request on decode")

    def _send(self, s: SendReq) -> None:
        row = self.rows.take()
        sender = Sender(self.agent, s.request_id)
        self._out[s.request_id] = _Out(sender, row, self._groups(s.blocks))
        if row is None:
            sender.abort("no free aux row on prefill (too many handoffs in flight)")
            return
        kv_pages: tuple[int, ...] = ()
        state: dict[str, object | None] = {}
        for name, blocks in zip(self.names, s.blocks, strict=True):
            if name == self.kv_name:
                kv_pages = blocks
            else:
                state[name] = list(blocks)
        if self.staging is not None:
            self.staging.to_host(s.blocks)  # synchronised: the transport reads them next
        self.rows.buffer[row * AUX.row_bytes:(row + 1) * AUX.row_bytes] = 0
        self._dump("prefill", s.request_id, s.blocks)
        sender.init(len(kv_pages), row, num_tokens=s.num_tokens)
        sender.send(list(kv_pages), state, last=True)

    def _receive(self, r: RecvReq) -> None:
        row = self.rows.take()
        entry = _In(None, row, r.blocks, self._groups(r.blocks))
        self._in[r.request_id] = entry
        if row is None:
            log.error("request %s: no free aux row on decode; failing its load", r.request_id)
            return
        rec = Receiver(self.agent, r.bootstrap, r.remote_id, instance=r.instance)
        entry.receiver = rec
        indices: dict[str, object | None] = {
            name: list(blocks) for name, blocks in zip(self.names, r.blocks, strict=True)}
        rec.init(indices, row, decode_prefix_len=r.prefix_tokens)

    def finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sends, finished receives, failed receives) since the last call. A
        failed receive is reported in both of the last two, as vLLM wants it (its
        ``kv_load_failure_policy`` then fails or recomputes the request)."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        for rid, o in list(self._out.items()):
            st = o.sender.poll()
            if st not in (Status.SUCCESS, Status.FAILED) or not o.sender.settled:
                continue
            del self._out[rid]
            if o.row is not None:
                self.rows.give(o.row)
            sending.add(rid)
            self._finish(rid, o.sender, st, o.groups)
        for rid, e in list(self._in.items()):
            rec = e.receiver
            st = rec.poll() if rec is not None else Status.FAILED
            if st is Status.SUCCESS:
                self._dump("decode", rec.request_id if rec else rid, e.lists)
            elif st is Status.FAILED and (rec is None or rec.released):
                if not e.aborted:
                    failed.add(rid)
            else:
                continue
            del self._in[rid]
            if e.row is not None:
                self.rows.give(e.row)
            if st is Status.SUCCESS and not e.aborted and not self._unstage(rid, e.lists):
                failed.add(rid)  # arrived, but not in vLLM's blocks: fail the load
                recving.add(rid)
                continue
            (sending if e.aborted else recving).add(rid)
            self._finish(rid, rec, st, e.groups)
        return sending, recving, failed

    def _unstage(self, rid: str, lists: tuple[tuple[int, ...], ...]) -> bool:
        """Decode: copy a received request's blocks into vLLM's tensors; False (logged and
        counted as ``StagingError``) when that fails."""
        if self.staging is None:
            return True
        try:
            self.staging.to_device(lists)
        except Exception:  # a failed copy fails this load, never the engine loop
            log.exception("request %s: received, but its blocks could not be copied into "
                          "vLLM's KV cache", rid)
            self.stats.outcome(self.role, "StagingError")
            return False
        return True

    def _finish(self, rid: str, side: Sender | Receiver | None, st: Status,
                groups: dict[str, int]) -> None:
        if st is Status.SUCCESS and side is not None:
            self.stats.outcome(self.role, "success")
            self.stats.phases(self.role, side.timeline, groups)
            self._dump_timing(side)
            return
        reason = _reason(side.error) if side is not None else "NoAuxRow"
        self.stats.outcome(self.role, reason)
        if side is not None and isinstance(side.error, LeaseExpired):
            return  # the library logged it when the lease ran out: once is enough
        log.warning("request %s: handoff failed on %s: %s", rid, self.role,
                    side.reason if side is not None else "no free aux row")

    def _dump(self, side: str, rid: object, lists: tuple[tuple[int, ...], ...]) -> None:
        """With ``KVHANDOFF_VLLM_DUMP=FILE``, append per component a digest of its moving
        blocks (tests compare prefill's with decode's, byte for byte) and their bytes.
        Without it, nothing is read: a handoff never pays for the digest."""
        if not os.environ.get("KVHANDOFF_VLLM_DUMP"):
            return
        _append_dump([
            {"side": side, "request": str(rid), "component": name, "blocks": len(blocks),
             "bytes": len(data), "sha256": hashlib.sha256(data.tobytes()).hexdigest()}
            for name, blocks in zip(self.names, lists, strict=True)
            for data in (block_bytes(self.layout, name, list(blocks)),)])

    def _dump_timing(self, side: Sender | Receiver) -> None:
        """With ``KVHANDOFF_VLLM_DUMP``, a successful handoff's phases in milliseconds
        (``handoff`` for the whole of it)."""
        end = side.timeline.span(tl.OPENED, tl.END[self.role])
        ms = {p: 1e3 * s for p, s in tl.phase_seconds(self.role, side.timeline).items()}
        _append_dump([{"side": self.role, "request": str(side.request_id),
                       "timing": {**ms, "handoff": None if end is None else 1e3 * end}}])

    def close(self) -> None:
        for o in self._out.values():
            o.sender.abort("vLLM worker shutting down")
        for e in self._in.values():
            if e.receiver is not None:
                e.receiver.abort("vLLM worker shutting down")
        self.agent.close()
        if self.staging is not None:  # once the transport is closed: nothing writes there
            self.staging.close()


def _append_dump(rows: list[dict[str, Any]]) -> None:
    path = os.environ.get("KVHANDOFF_VLLM_DUMP")
    if path and rows:
        with open(path, "a") as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows))


def block_bytes(layout: Layout, name: str, blocks: list[int]) -> np.ndarray[Any, Any]:
    """``blocks`` of every tensor of component ``name``, concatenated (for comparisons);
    blocks in GPU memory are copied to the host first."""
    c = layout.component(name)
    parts = [_read(t.ptr + b * t.item_stride, t.item_bytes, t.memory, t.device)
             for t in c.tensors for b in blocks]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint8)


def _read(ptr: int, nbytes: int, memory: MemoryKind, device: int) -> np.ndarray[Any, Any]:
    """A copy of ``nbytes`` at ``ptr`` (a host view when the memory is the host's)."""
    if memory is MemoryKind.HOST:
        return raw_view(ptr, nbytes)
    import torch

    ref = SimpleNamespace(__cuda_array_interface__={  # how torch reads a device pointer
        "shape": (nbytes,), "typestr": "|u1", "data": (ptr, True), "version": 3})
    return torch.as_tensor(ref, device=f"cuda:{device}").cpu().numpy()
