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
SUCCESS) from the kit's :class:`~kvhandoff.integrations.AuxPool` for its lifetime. When a
request is over for vLLM is the kit's outcome table (:func:`kvhandoff.integrations.outcome`).
A :class:`~kvhandoff.integrations.HandoffHook` (a test rig's; none by default) hears of
each send, landing and finished handoff.

With a :class:`Staging` (vLLM's KV in GPU memory over tcp/shm, or ``host_staging``), the
layout describes a host mirror: prefill copies a request's blocks into it before its
send starts, decode copies them out of it once the receive succeeded and before vLLM
hears of it (a copy that fails fails the load). The worker owns the staging: closing
the worker closes it, after the transport.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvhandoff.integrations import (
    AuxPool,
    Figures,
    HandoffHook,
    HandshakeError,
    LeaseExpired,
    LocalProtocolError,
    Outcome,
    Receiver,
    RequestKey,
    Role,
    Sender,
    SessionConfig,
    Transport,
    as_decode,
    as_prefill,
    figures,
    open_rank,
    outcome,
)
from kvhandoff.integrations.vllm.requests import RecvReq, SendReq, StepMeta
from kvhandoff.layout import Layout

log = logging.getLogger("kvhandoff.integrations.vllm")

AUX_NAME = "aux"


class Staging(Protocol):
    """Moves a request's blocks (one list per group) between vLLM's tensors and the
    memory the layout describes (:class:`~.host_staging.HostStaging`)."""

    def to_host(self, blocks: Sequence[Sequence[int]]) -> None: ...

    def to_device(self, blocks: Sequence[Sequence[int]]) -> None: ...

    def close(self) -> None: ...


STAT_KEYS = ("handoff_seconds", "phase_seconds", "bytes", "group_bytes", "outcomes")


class Stats:
    """Observations since the last report, as vLLM's connector stats want them: a dict of
    lists of plain values (it pickles them from the worker to the process that exports
    metrics), each row taken from one handoff's :class:`~kvhandoff.integrations.Figures`.

    ``handoff_seconds``: per successful handoff ``[role, seconds]``; ``phase_seconds``:
    ``[role, phase, seconds]``; ``bytes`` and ``group_bytes``: what a successful handoff
    moved (``[role, n]``, ``[role, component, n]``); ``outcomes``: ``[role, "success" or
    the error class]``."""

    def __init__(self) -> None:
        self.data: dict[str, list[list[object]]] = {k: [] for k in STAT_KEYS}

    def take(self) -> dict[str, list[list[object]]]:
        out, self.data = self.data, {k: [] for k in STAT_KEYS}
        return out

    def empty(self) -> bool:
        return not any(self.data.values())

    def add(self, f: Figures) -> None:
        self.data["outcomes"].append([f.role, f.outcome])
        if not f.success:
            return
        if f.seconds is not None:
            self.data["handoff_seconds"].append([f.role, f.seconds])
        self.data["phase_seconds"].extend([f.role, p, s] for p, s in f.phases.items())
        self.data["bytes"].append([f.role, f.nbytes])
        self.data["group_bytes"].extend([f.role, g, n] for g, n in f.component_bytes.items())


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


def _key(text: str) -> RequestKey | None:
    """The request's key the scheduler passed (hex; its scheduler checked it), or None."""
    return RequestKey.from_hex(text) if text else None


class WorkerSide:
    """See the module docstring. Called from vLLM's step thread only."""

    def __init__(self, layout: Layout, rows: AuxPool, *, producer: bool, bootstrap: str,
                 config: SessionConfig, kv_name: str | None,
                 staging: Staging | None = None, transport: Transport | None = None,
                 hook: HandoffHook | None = None) -> None:
        self.producer = producer
        self.hook = hook
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
        self.agent = open_rank(layout, config, role=Role.PREFILL if producer else Role.DECODE,
                               bootstrap_url=bootstrap if producer else None,
                               transport=transport)
        if not producer:
            self._check_pair(bootstrap)

    def _check_pair(self, bootstrap: str) -> None:
        """Decode: handshake prefill now, so an incompatible pair stops vLLM at start-up
        (the message names every field that differs). A prefill that is not up yet is
        handshaken on the first request instead."""
        why = as_decode(self.agent).handshake(bootstrap)
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
        sender = Sender(as_prefill(self.agent), s.request_id, key=_key(s.key))
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
        self.rows.row(row)[:] = 0
        self._tell("sending", s.request_id, s.blocks)
        sender.init(len(kv_pages), row, num_tokens=s.num_tokens)
        sender.send(list(kv_pages), state, last=True)

    def _receive(self, r: RecvReq) -> None:
        row = self.rows.take()
        entry = _In(None, row, r.blocks, self._groups(r.blocks))
        self._in[r.request_id] = entry
        if row is None:
            log.error("request %s: no free aux row on decode; failing its load", r.request_id)
            return
        rec = Receiver(as_decode(self.agent), r.bootstrap, r.remote_id, key=_key(r.key),
                       instance=r.instance)
        entry.receiver = rec
        indices: dict[str, object | None] = {
            name: list(blocks) for name, blocks in zip(self.names, r.blocks, strict=True)}
        rec.init(indices, row, decode_prefix_len=r.prefix_tokens)

    def finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sends, finished receives, failed receives) since the last call, as
        the kit's outcome table says (a request is over once nothing touches its blocks).
        A failed receive is reported in both of the last two, as vLLM wants it (its
        ``kv_load_failure_policy`` then fails or recomputes the request)."""
        sending: set[str] = set()
        recving: set[str] = set()
        failed: set[str] = set()
        for rid, o in list(self._out.items()):
            if outcome(o.sender).outcome is Outcome.PENDING:
                continue
            del self._out[rid]
            if o.row is not None:
                self.rows.give(o.row)
            sending.add(rid)
            self._finish(rid, o.sender, o.groups)
        for rid, e in list(self._in.items()):
            rec = e.receiver
            result = outcome(rec).outcome if rec is not None else Outcome.FAILED
            if result is Outcome.PENDING:
                continue
            del self._in[rid]
            if e.row is not None:
                self.rows.give(e.row)
            if result is Outcome.SUCCEEDED:
                self._tell("landed", rec.request_id if rec else rid, e.lists)
                if not e.aborted and not self._unstage(rid, e.lists):
                    failed.add(rid)  # arrived, but not in vLLM's blocks: fail the load
                    recving.add(rid)
                    continue
            elif not e.aborted:
                failed.add(rid)
            (sending if e.aborted else recving).add(rid)
            self._finish(rid, rec, e.groups)
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
            self.stats.add(Figures(role=self.role, outcome="StagingError"))
            return False
        return True

    def _finish(self, rid: str, side: Sender | Receiver | None, groups: dict[str, int]) -> None:
        if side is None:
            self.stats.add(Figures(role=self.role, outcome="NoAuxRow"))
            log.warning("request %s: handoff failed on %s: no free aux row", rid, self.role)
            return
        f = figures(self.role, side, component_bytes=groups)
        self.stats.add(f)
        if self.hook is not None:
            self.hook.finished(str(side.request_id), f)
        # a lease that ran out was logged by the library when it did: once is enough
        if not f.success and not isinstance(side.error, LeaseExpired):
            log.warning("request %s: handoff failed on %s: %s", rid, self.role, side.reason)

    def _tell(self, event: str, rid: object, lists: tuple[tuple[int, ...], ...]) -> None:
        """Hand the hook (if any) the blocks of each component a request moves."""
        if self.hook is None:
            return
        named = dict(zip(self.names, lists, strict=True))
        if event == "sending":
            self.hook.sending(str(rid), self.layout, named)
        else:
            self.hook.landed(str(rid), self.layout, named)

    def close(self) -> None:
        for o in self._out.values():
            o.sender.abort("vLLM worker shutting down")
        for e in self._in.values():
            if e.receiver is not None:
                e.receiver.abort("vLLM worker shutting down")
        self.agent.close()
        if self.staging is not None:  # once the transport is closed: nothing writes there
            self.staging.close()
