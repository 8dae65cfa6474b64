"""The engine's :class:`~kvhandoff.lab.engine.transfer.Transfer` over kvhandoff's session layer.

Each rank gets an :class:`~kvhandoff.session.rank.agent.Agent` (prefill agents register with a
bootstrap server) over a real transport (``tcp`` by default), and each request becomes
one :class:`~kvhandoff.session.request.sender.Sender` per prefill rank and one
:class:`~kvhandoff.session.request.receiver.Receiver` per decode rank:

==========================  ==========================================================
engine call                 session call
==========================  ==========================================================
``open`` (decode rank d)    ``Receiver(agent_d, url, rid).init(lists, aux_row, prefix)``
``start`` (prefill rank p)  ``Sender(agent_p, rid).init(num_pages, aux_row)``, then
                            ``wait_bootstrapped`` and ``decode_prefix_len``
``send``                    ``Sender.send(pages, state, last=...)``
``settle``                  ``Sender.wait`` (SUCCESS) and ``Sender.wait_settled``
``wait``                    ``Receiver.wait`` (SUCCESS) on every decode rank
==========================  ==========================================================

The two halves are separate classes so a prefill process and a decode process each
hold only their own (:class:`PrefillLink`, :class:`DecodeLink`); :class:`SessionLink`
joins them for one process.

Each request is bound to its decode (:mod:`kvhandoff.binding`) as an engine whose router
gives both sides only the request's id does it (SGLang's rooms): its key is derived from
the id under ``router_secret``, a secret the run's driver hands both halves (the demo
draws one per run; :class:`SessionLink` one per link), else under the deployment secret
(:meth:`~kvhandoff.binding.RequestKey.for_room`). Only when the deployment runs
``insecure`` and no router secret is given do requests go unbound.

Bytes per component are counted on decode from its own destination lists (each
destination item is written exactly once).

``transport`` names any transport of :mod:`kvhandoff.transport.registry` (``tcp``,
``shm``, ``mooncake``, ``nixl``, …); each rank gets its own instance, opened as every
engine's is (:func:`kvhandoff.integrations.open_rank`): keyed by the deployment secret of
``config`` (default: the environment's). A transport whose destinations must come from
its ``allocate`` (shm) gets them: decode relocates each rank's pools into that memory
(:meth:`~kvhandoff.lab.engine.pools.RankPools.relocate`) before registering them, as
:func:`kvhandoff.integrations.placement` decides.
"""

from __future__ import annotations

import secrets
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import Self

from kvhandoff.errors import LayoutError
from kvhandoff.integrations import (
    DecodeAgent,
    How,
    PrefillAgent,
    Receiver,
    RequestKey,
    Role,
    Sender,
    SessionConfig,
    Status,
    Transport,
    open_rank,
    open_transport,
    placement,
)
from kvhandoff.lab.engine.transfer import Chunk, Endpoint, ItemList, Relocatable, TransferReport
from kvhandoff.layout import Layout
from kvhandoff.protocol import IndexListMsg
from kvhandoff.session.errors import SessionError


class LinkError(RuntimeError):
    """A request did not reach SUCCESS in time; the message carries the session's reason."""


def landed_bytes(layout: Layout, lists: Mapping[str, ItemList]) -> dict[str, int]:
    """Bytes one decode rank receives per component: every destination item, whole."""
    out = {}
    for c in layout.components:
        n = len(lists[c.name].items)
        nbytes = n * sum(t.item_bytes for t in c.tensors)
        if nbytes:
            out[c.name] = nbytes
    return out


def decode_transport(rank: Endpoint, config: SessionConfig, label: str) -> Transport | None:
    """The transport one decode rank must register with, made first when its
    destinations must come from the transport's own ``allocate`` (the rank's pools move
    there); None when the agent may make its own."""
    try:
        where = placement(config.transport, producer=False,
                          relocate=isinstance(rank, Relocatable), engine=label)
    except LayoutError as e:
        raise LinkError(f"{label}: {e} ({type(rank).__name__} cannot relocate its "
                        f"buffers)") from e
    if where.how is How.IN_PLACE:
        return None
    assert isinstance(rank, Relocatable)
    t = open_transport(config)
    try:
        rank.relocate(t.allocate)
    except BaseException:
        t.close()
        raise
    return t


def _config(config: SessionConfig | None, transport: str) -> SessionConfig:
    return (config if config is not None else SessionConfig.from_env()).replace(
        transport=transport)


def request_keys(router_secret: bytes | None, config: SessionConfig | None = None
                 ) -> Callable[[int], RequestKey | None]:
    """How a link keys request ``rid``: under ``router_secret``, else under the deployment
    secret of ``config`` (default: the environment's settings), else (insecure) not at all."""
    if router_secret is not None:
        return lambda rid: RequestKey.derive(router_secret, rid)
    secret = (config if config is not None else SessionConfig.from_env()).secret()
    if secret is None:
        return lambda rid: None
    return lambda rid: RequestKey.for_room(rid, secret)


def _check(status: Status, what: str, error: SessionError | None) -> None:
    if status is not Status.SUCCESS:
        raise LinkError(f"{what} ended {status.value}: {error}")


class PrefillLink:
    """The prefill half: one agent per prefill rank. Not thread-safe per request.
    ``router_secret``: see the module docstring (the decode half's must be the same)."""

    def __init__(self, ranks: Sequence[Endpoint], bootstrap_url: str, *,
                 transport: str = "tcp", timeout: float = 60.0,
                 config: SessionConfig | None = None,
                 router_secret: bytes | None = None) -> None:
        self.timeout = timeout
        self._senders: dict[tuple[int, int], Sender] = {}
        self.agents: list[PrefillAgent] = []
        cfg = _config(config, transport)
        self._key = request_keys(router_secret, cfg)
        try:
            for i, r in enumerate(ranks):
                self.agents.append(open_rank(r.layout, cfg, role=Role.PREFILL,
                                             bootstrap_url=bootstrap_url,
                                             name=f"prefill-tp{i}"))
        except BaseException:
            self.close()
            raise

    def start(self, rid: int, prefill_rank: int, num_pages: int, aux_row: int) -> int:
        s = Sender(self.agents[prefill_rank], rid, key=self._key(rid))
        self._senders[(rid, prefill_rank)] = s
        s.init(num_pages, aux_row)
        if s.wait_bootstrapped(self.timeout) is Status.FAILED:
            raise LinkError(f"request {rid} prefill rank {prefill_rank}: {s.error}")
        prefix = s.decode_prefix_len
        if prefix is None:
            raise LinkError(f"request {rid}: decode's indices did not arrive in "
                            f"{self.timeout} s")
        return prefix

    def send(self, rid: int, prefill_rank: int, chunk: Chunk) -> None:
        s = self._senders[(rid, prefill_rank)]
        state = None
        if chunk.last:
            aux = self.agents[prefill_rank].aux_name  # the aux row went with start()
            state = {k: v.items for k, v in (chunk.state or {}).items() if k != aux}
        s.send(chunk.pages, state, last=chunk.last)

    def settle(self, rid: int, prefill_rank: int) -> None:
        s = self._senders.pop((rid, prefill_rank))
        _check(s.wait(self.timeout), f"request {rid} prefill rank {prefill_rank}", s.error)
        if not s.wait_settled(self.timeout):
            raise LinkError(f"request {rid}: writes still in flight after {self.timeout} s")

    def close(self) -> None:
        for a in self.agents:
            a.close()


class DecodeLink:
    """The decode half: one agent per decode rank. Not thread-safe per request.
    ``router_secret``: see the module docstring (the prefill half's must be the same)."""

    def __init__(self, ranks: Sequence[Endpoint], bootstrap_url: str, *,
                 transport: str = "tcp", timeout: float = 60.0,
                 config: SessionConfig | None = None,
                 router_secret: bytes | None = None) -> None:
        self.url, self.timeout = bootstrap_url, timeout
        self.agents: list[DecodeAgent] = []
        cfg = _config(config, transport)
        self._key = request_keys(router_secret, cfg)
        try:
            for i, r in enumerate(ranks):
                t = decode_transport(r, cfg, f"decode-tp{i}")
                self.agents.append(open_rank(r.layout, cfg, role=Role.DECODE, transport=t,
                                             name=f"decode-tp{i}"))
        except BaseException:
            self.close()
            raise
        self._receivers: dict[int, list[tuple[Receiver, dict[str, int]]]] = defaultdict(list)

    def open(self, rid: int, decode_rank: int, lists: Mapping[str, ItemList],
             prefix_len: int) -> None:
        agent = self.agents[decode_rank]
        indices: dict[str, object | None] = {
            name: (IndexListMsg.of(v.items, positions=v.positions)
                   if v.positions is not None else v.items)
            for name, v in lists.items() if name != agent.aux_name}
        aux_row = int(lists[agent.aux_name].items[0]) if agent.aux_name else None
        r = Receiver(agent, self.url, rid, key=self._key(rid))
        r.init(indices, aux_row, decode_prefix_len=prefix_len)
        self._receivers[rid].append((r, landed_bytes(agent.layout, lists)))

    def wait(self, rid: int) -> TransferReport:
        report = TransferReport()
        for r, nbytes in self._receivers.pop(rid):
            _check(r.wait(self.timeout), f"request {rid} decode", r.error)
            for name, n in nbytes.items():
                report.bytes_by_component[name] += n
        report.bytes_by_component = dict(report.bytes_by_component)
        return report

    def close(self) -> None:
        for a in self.agents:
            a.close()


class SessionLink:
    """Both halves in one process: a drop-in for
    ``run_disaggregated(..., transfer=lambda p, d: SessionLink(p, d, url))``."""

    def __init__(self, prefill: Sequence[Endpoint], decode: Sequence[Endpoint],
                 bootstrap_url: str, *, transport: str = "tcp", timeout: float = 60.0,
                 config: SessionConfig | None = None) -> None:
        routed = secrets.token_bytes(32)  # this link routes every request: its own secret
        self.decode = DecodeLink(decode, bootstrap_url, transport=transport, timeout=timeout,
                                 config=config, router_secret=routed)
        try:
            self.prefill = PrefillLink(prefill, bootstrap_url, transport=transport,
                                       timeout=timeout, config=config, router_secret=routed)
        except BaseException:
            self.decode.close()
            raise
        self.open, self.wait = self.decode.open, self.decode.wait
        self.start, self.send = self.prefill.start, self.prefill.send
        self.settle = self.prefill.settle

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
