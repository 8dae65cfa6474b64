r"""An in-process session rig for fault tests: one prefill and one decode agent of a tiny
model in this process, real memory, the tcp transport, short timeouts. Test support.

:class:`Rig` builds both agents (prefill registers with the given bootstrap server),
creates Receivers and Senders for :class:`~kvhandoff.lab.testing.handoff.RequestPlan`\ s with
the same indices the cross-process harness uses, and runs whole handoffs.
:meth:`Rig.add_decode` adds more decode agents (other decode deployments of the same
layout, each with its own memory) that the one prefill agent serves too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhandoff.binding import RequestKey
from kvhandoff.lab.testing.handoff import (
    AUX,
    DECODE,
    PREFILL,
    Arena,
    RequestPlan,
    Scenario,
    Topology,
    aux_name,
    chunks_of,
    decode_lists,
    first_token,
    kv_name,
    layout_of,
    prefill_pages,
    prefill_state,
    request_of,
)
from kvhandoff.layout import Layout
from kvhandoff.session import Agent, DecodeAgent, Receiver, Sender, SessionConfig, Status
from kvhandoff.transport import Transport, create_transport

FAST: dict[str, Any] = {"transport": "tcp", "bootstrap_timeout": 5.0, "indices_timeout": 5.0,
                        "waiting_timeout": 5.0, "transfer_timeout": 5.0,
                        "release_timeout": 3.0, "heartbeat_interval": 0.1,
                        "heartbeat_timeout": 1.0, "register_retries": 0, "workers": 2}


def kvh_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvh")]


def config(instance: str, **kw: Any) -> SessionConfig:
    return SessionConfig.from_env({}, **{**FAST, "instance": instance, **kw})


@dataclass(frozen=True, slots=True)
class DecodeSide:
    """A decode agent of the rig, its layout and its memory."""

    agent: DecodeAgent
    dst: Layout
    arena: Arena


class Rig:
    """One prefill and one decode agent of tiny qwen3_next (TP 1 each, unless the
    topology says otherwise: then rank 0 of each side), in this process, on
    ``transport`` (tcp unless told)."""

    def __init__(self, url: str, instance: str, *, topo: Topology | None = None,
                 prefill_cfg: dict[str, Any] | None = None,
                 decode_cfg: dict[str, Any] | None = None,
                 prefill_transport: Transport | None = None,
                 decode_layout: Layout | None = None, transport: str = "tcp") -> None:
        self.url, self._transport = url, transport
        self.topo = topo or Topology(shape="qwen3_next", num_pages=64)
        self.scn = Scenario(topo=self.topo, requests=())
        self.parena = Arena((0, PREFILL, 0, 0, 0))
        self.darena = Arena((0, DECODE, 0, 0, 0))
        self.src = layout_of(self.topo, PREFILL, 0, 0, self.parena)
        self.dst = decode_layout or layout_of(self.topo, DECODE, 0, 0, self.darena)
        self.prefill_cfg = config(instance, **(prefill_cfg or {}))
        self.prefill = Agent.prefill(self.src, bootstrap_url=url, config=self.prefill_cfg,
                                     transport=prefill_transport or self._own(transport))
        try:
            self.decode = Agent.decode(self.dst, config=config(
                instance, **{"transport": transport, **(decode_cfg or {})}))
        except BaseException:
            self.prefill.close()
            raise
        self.decodes: list[DecodeSide] = [DecodeSide(self.decode, self.dst, self.darena)]
        self._instance = instance

    def add_decode(self, *, decode_cfg: dict[str, Any] | None = None,
                   transport: Transport | None = None) -> DecodeSide:
        """Another decode agent (a separate decode deployment: its own control and
        transport endpoints, its own seeded memory) with the rig's decode layout."""
        arena = Arena((len(self.decodes), DECODE, 0, 0, 0))
        dst = layout_of(self.topo, DECODE, 0, 0, arena)
        agent = Agent.decode(dst, config=config(self._instance, **(decode_cfg or {})),
                             transport=transport)
        side = DecodeSide(agent, dst, arena)
        self.decodes.append(side)
        return side

    def plan(self, rid: Any, *, block: int = 0, num_tokens: int = 21, chunk_pages: int = 2,
             **kw: Any) -> RequestPlan:
        return RequestPlan(rid=rid, num_tokens=num_tokens, block=block, chunk_pages=chunk_pages,
                           seed=block, **kw)

    def receiver(self, rp: RequestPlan, *, init: bool = True, on: DecodeSide | None = None,
                 key: RequestKey | None = None) -> Receiver:
        """A Receiver on the rig's decode agent (or on ``on``), init'ed unless told not;
        ``key``: the request's (:mod:`kvhandoff.binding`)."""
        agent, dst = (self.decode, self.dst) if on is None else (on.agent, on.dst)
        r = Receiver(agent, self.url, rp.rid, key=key)
        if init:
            lists, row = decode_lists(request_of(self.scn, rp, self.src, dst), dst)
            r.init(lists, row, decode_prefix_len=rp.prefix_len)
        return r

    def sender(self, rp: RequestPlan, *, key: RequestKey | None = None
               ) -> tuple[Sender, list[np.ndarray], dict[str, object]]:
        """A Sender, init'ed, with its aux row packed; returns its chunks and state.
        ``key``: the request's (:mod:`kvhandoff.binding`)."""
        s = Sender(self.prefill, rp.rid, key=key)
        req = request_of(self.scn, rp, self.src, self.dst)
        pages = prefill_pages(self.topo, rp, req, kv_name(self.src))
        s.init(len(pages), rp.block + 1)
        ax = aux_name(self.src)
        assert ax is not None
        row = self.prefill.views.row(self.src.component(ax).tensors[0], rp.block + 1)
        assert row is not None
        AUX.pack(row, first_token=first_token(rp.rid))
        return s, chunks_of(rp, pages), prefill_state(req, self.src)

    def send_all(self, s: Sender, chunks: list[np.ndarray], state: dict[str, object]) -> None:
        for i, c in enumerate(chunks):
            last = i == len(chunks) - 1
            s.send(c, state_indices=state if last else None, last=last)

    def handoff(self, rp: RequestPlan, *, on: DecodeSide | None = None,
                key: RequestKey | None = None) -> tuple[Sender, Receiver]:
        r = self.receiver(rp, on=on, key=key)
        s, chunks, state = self.sender(rp, key=key)
        self.send_all(s, chunks, state)
        assert r.wait(10) is Status.SUCCESS, r.reason
        assert s.wait(10) is Status.SUCCESS, s.reason
        return s, r

    def restart_prefill(self) -> None:
        """Close the prefill agent and start a new one as a restarted process would: same
        layout and control endpoint, a fresh transport, no memory of any handshake."""
        port = int(self.prefill.endpoint.rsplit(":", 1)[1])
        self.prefill.close()
        self.prefill = Agent.prefill(self.src, bootstrap_url=self.url,
                                     config=self.prefill_cfg.replace(port=port),
                                     transport=self._own(self._transport))

    def _own(self, name: str) -> Transport:
        """The prefill agent's transport, keyed with the deployment secret if it has one."""
        return create_transport(name, data_secret=self.prefill_cfg.data_key())

    def close(self) -> None:
        for d in self.decodes[1:]:
            d.agent.close()
        self.decode.close()
        self.prefill.close()
