"""kvhandoff as SGLang's ``kvhandoff`` transfer backend: the four classes. Imports SGLang.

They subclass SGLang's ``Common*`` classes, whose attributes the scheduler reads, and keep
what routers and launchers rely on: SGLang's bootstrap server and its ``/route``
registry (prefill ranks still register there, decode still reads the prefill topology
from it), rooms (``bootstrap_room`` is the kvhandoff request id) and ``KVPoll`` polling.
Underneath, every rank is a kvhandoff agent (the integration kit's ``open_rank``: its
layout from ``KVArgs`` through :mod:`.layout`, a transport keyed by the deployment secret)
and every request a kvhandoff Sender (prefill) or Receiver (decode):

==================================  ==================================================
SGLang calls                        kvhandoff
==================================  ==================================================
``Manager(kv_args, mode, ...)``     ``open_rank``; a prefill rank also registers with
                                    kvhandoff's registry, which SGLang's bootstrap
                                    server hosts under ``/kvhandoff``
``manager.try_ensure_parallel_info``  SGLang's topology lookup, then kvhandoff's
                                    handshake with that prefill: a pair whose layouts
                                    differ is refused here, every difference named
``Sender(mgr, addr, room)``         ``Sender(agent, room, key)``
``sender.pop_decode_prefix_len``    ``Sender.decode_prefix_len``
``sender.init`` / ``send``          ``Sender.init`` / ``send`` (via the manager's
                                    ``add_transfer_request``; pages from token 0)
``Receiver(mgr, addr, room)``,      ``Receiver(agent, addr/kvhandoff, room, key)``,
``receiver.init(dp_rank)``          ready for metadata at once
``receiver.send_metadata``          ``Receiver.init`` (every component's indices)
``poll``                            the kit's outcome table (``kvpoll``): a failed
                                    request is reported only once no write touches
                                    its pages
``abort`` / ``failure_exception``   ``abort`` / ``KVTransferError`` with the reason
``get_transfer_metric``             the handoff's figures (transfer phase, bytes)
==================================  ==================================================

**The request's key.** SGLang's router hands prefill and decode only the room, so both
sides derive the request's key from it and the deployment secret
(``RequestKey.for_room``; none when ``insecure``): prefill writes a request's KV only to
the decode ranks that prove they hold its room's key.

**The lease.** The scheduler hands the sender its last chunk as soon as prefill is done
(``send`` → kvhandoff's last chunk, which starts ``SessionConfig.lease``) and keeps
polling it in its inflight queue; ``poll`` says Success or Failed only once the Sender
is settled, so SGLang frees the pages and the metadata row when nothing reads them any
more, whatever the outcome (``LeaseExpired`` included).

Control messages travel over kvhandoff's control plane (signed with a deployment secret),
bytes over the configured kvhandoff transport (``KVHANDOFF_TRANSPORT``, ``auto`` by
default), timeouts and liveness are kvhandoff's (``KVHANDOFF_*``,
:class:`~kvhandoff.integrations.SessionConfig`). SGLang's own ZMQ socket of each rank is
opened by the base class and stays idle. Not supported (refused at start-up): pipeline
parallelism, host KV destinations, state types :mod:`.layout` names as refused.
"""

from __future__ import annotations

import atexit
import importlib.metadata
import logging
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import (
    KVArgs,
    KVTransferDestination,
    KVTransferMetric,
)
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
    KVTransferError,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_device
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils.network import NetworkAddress

from kvhandoff.errors import LayoutError
from kvhandoff.integrations import (
    KVPOLL,
    Agent,
    AuxSpec,
    Figures,
    HandshakeError,
    Receiver,
    RequestKey,
    Role,
    Sender,
    SessionConfig,
    Status,
    as_decode,
    as_prefill,
    bootstrap_url,
    figures,
    kvpoll,
    open_rank,
    placement,
)
from kvhandoff.integrations.sglang.kvargs import model_facts, model_heads, registered
from kvhandoff.integrations.sglang.layout import describe
from kvhandoff.integrations.sglang.requests import (
    decode_indices,
    from_token_zero,
    prefill_state,
    prefix_pages,
)
from kvhandoff.integrations.sglang.server import PREFIX, mount_registry
from kvhandoff.layout import MemoryKind

log = logging.getLogger("kvhandoff.integrations.sglang")

FAILED, SUCCESS = KVPOLL["Failed"], KVPOLL["Success"]
BOOTSTRAPPING, WAITING = KVPOLL["Bootstrapping"], KVPOLL["WaitingForInput"]
TRANSFERRING = KVPOLL["Transferring"]
FINAL = (SUCCESS, FAILED)


def held_in_bootstrap(state: int, failed: bool) -> int:
    """``state`` for SGLang's bootstrap (prefill) and prealloc (decode) queues, which
    take only Bootstrapping, WaitingForInput and Failed (anything else kills the
    scheduler). A request that failed there but whose side is not quiet yet is held as
    Transferring by the outcome table; it waits as Bootstrapping until it is quiet and
    says Failed."""
    return BOOTSTRAPPING if state == TRANSFERRING and failed else state

HANDSHAKE_TIMEOUT = 5.0
"""Seconds decode's scheduler waits for the handshake with a new prefill (it runs on the
scheduler thread once per prefill, like SGLang's own topology lookup)."""


def session_config() -> SessionConfig:
    """kvhandoff's settings (``KVHANDOFF_*``). A prefill rank may start before SGLang's
    bootstrap server (the launcher starts it beside the schedulers): registration retries
    longer than kvhandoff's default."""
    cfg = SessionConfig.from_env()
    if cfg.register_retries == SessionConfig().register_retries:
        cfg = cfg.replace(register_retries=10)
    return cfg


class KvhandoffKVManager(CommonKVManager):  # type: ignore[misc]
    """One SGLang rank: its kvhandoff agent (see the module docstring)."""

    _agent: Agent | None = None

    def __init__(self, args: KVArgs, disaggregation_mode: DisaggregationMode,
                 server_args: ServerArgs, is_mla_backend: bool | None = False) -> None:
        self.config = session_config()
        self.secret = self.config.secret()  # read once: every request's key derives from it
        self.senders: dict[int, _Outgoing] = {}
        self.refusals: dict[str, str] = {}  # decode: bootstrap address -> handshake refusal
        self.handshaken: set[str] = set()
        self.types = [s.type for s in registered(args).states]
        self._opening = (args, server_args, bool(is_mla_backend))
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        if self._agent is None:  # decode (prefill opened it on registering)
            self._agent = self._open(*self._opening)
        atexit.register(self.close)  # deregister and close sockets when the process ends

    def register_to_bootstrap(self) -> None:
        """Prefill: open the rank's agent, which registers with kvhandoff's registry, then
        register in SGLang's ``/route`` table: once decode sees the prefill deployment
        complete there, kvhandoff's handshake finds every rank."""
        if self.pp_size > 1:
            raise LayoutError(f"kvhandoff's SGLang backend moves no pipeline-parallel "
                              f"state yet (PP {self.pp_size}); run PP 1 on both sides")
        self._agent = self._open(*self._opening)
        super().register_to_bootstrap()

    @property
    def agent(self) -> Agent:
        """The rank's kvhandoff agent."""
        if self._agent is None:
            raise RuntimeError("the kvhandoff agent is not open yet")
        return self._agent

    def _open(self, args: KVArgs, server_args: ServerArgs, mla: bool) -> Agent:
        prefill = self.disaggregation_mode == DisaggregationMode.PREFILL
        cuda = get_device().device == "cuda"
        where = placement(self.config.transport, producer=prefill, cuda=cuda,
                          gpu_direct=cuda, engine="SGLang")
        cfg = self.config.replace(transport_options={**self.config.transport_options,
                                                     **where.transport_options()})
        reg = registered(args, is_mla=mla,
                         heads=None if mla else model_heads(self.attn_tp_size))
        rows = int(args.aux_data_lens[0] // args.aux_item_lens[0])
        self.guard, guard = AuxSpec().allocate(rows)  # row i guards metadata row i
        dims, model = model_facts(server_args)
        layout = describe(reg, tp_rank=self.attn_tp_rank, tp_size=self.attn_tp_size,
                          mamba2=dims, extra=(guard,),
                          memory=MemoryKind.CUDA if cuda else MemoryKind.HOST,
                          device=int(get_device().gpu_id or 0) if cuda else 0,
                          identity=(model, ("sglang", importlib.metadata.version("sglang")),
                                    ("kv_cache_dtype", reg.kv_cache_dtype)))
        if prefill:
            return open_rank(layout, cfg, role=Role.PREFILL, bootstrap_url=self._registry(),
                             dp_rank=self.attn_dp_rank, dp_size=self.attn_dp_size,
                             name=f"sglang-prefill-tp{self.attn_tp_rank}")
        return open_rank(layout, cfg, role=Role.DECODE,
                         name=f"sglang-decode-tp{self.attn_tp_rank}")

    def _registry(self) -> str:
        """kvhandoff's registry on this prefill's SGLang bootstrap server (the address
        SGLang's own ``register_to_bootstrap`` uses)."""
        if self.dist_init_addr:
            host = str(NetworkAddress.parse(self.dist_init_addr).resolved().host)
        else:
            bound = str(self.bootstrap_host)
            host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(bound, bound)
        return str(NetworkAddress(host, self.bootstrap_port).to_url()) + PREFIX

    # --- decode ----------------------------------------------------------------------

    def try_ensure_parallel_info(self, bootstrap_addr: str) -> bool:
        """SGLang's topology lookup, then (once per prefill) kvhandoff's handshake: an
        incompatible pair is refused here, and every request to it fails with the
        handshake's reason (each field that differs, with both values)."""
        if not super().try_ensure_parallel_info(bootstrap_addr):
            return False
        if bootstrap_addr in self.handshaken or bootstrap_addr in self.refusals:
            return True
        why = as_decode(self.agent).handshake(registry_url(bootstrap_addr),
                                              timeout=HANDSHAKE_TIMEOUT)
        if isinstance(why, HandshakeError):
            self.refusals[bootstrap_addr] = f"kvhandoff refuses this prefill/decode pair: {why}"
            log.error("%s (prefill %s)", self.refusals[bootstrap_addr], bootstrap_addr)
            return True
        if why is not None:  # not reachable yet: SGLang asks again
            log.warning("kvhandoff: prefill %s not handshaken yet: %s", bootstrap_addr, why)
            return False
        self.handshaken.add(bootstrap_addr)
        return True

    def request_key(self, bootstrap_room: int) -> RequestKey | None:
        """The key binding request ``bootstrap_room`` to its decode: derived from the room
        and the deployment secret, so prefill and decode (and nobody without the secret)
        compute the same one with nothing sent; None without a secret (``insecure``)."""
        return None if self.secret is None else RequestKey.for_room(bootstrap_room,
                                                                     self.secret)

    # --- prefill ---------------------------------------------------------------------

    def add_transfer_request(self, bootstrap_room: int, kv_indices: npt.ArrayLike,
                             index_slice: slice, is_last_chunk: bool,
                             aux_index: int | None = None, state_indices: list[Any] | None = None,
                             num_kv_tokens: int | None = None, **_: Any) -> None:
        """One chunk of a request (``CommonKVSender.send`` calls this): handed to its
        kvhandoff Sender, pages counted from token 0."""
        out = self.senders.get(bootstrap_room)
        if out is None:
            return  # cleared, or never ours
        out.send(kv_indices, is_last_chunk, aux_index, state_indices, self.types)

    def close(self) -> None:
        """Close the agent (its transport, sockets, threads; prefill: deregister);
        idempotent."""
        if self._agent is not None:
            self._agent.close()


def registry_url(bootstrap_addr: str) -> str:
    """kvhandoff's registry on the SGLang bootstrap server at ``host:port``."""
    return bootstrap_url(bootstrap_addr) + PREFIX


class _Outgoing:
    """A prefill request's kvhandoff Sender and the placeholder pages its first chunk
    starts with (decode's prefix)."""

    def __init__(self, sender: Sender) -> None:
        self.sender = sender
        self.skip = 0
        self.chunks = 0  # handed to the Sender: until the first, SGLang's bootstrap queue polls

    def send(self, pages: npt.ArrayLike, last: bool, aux_index: int | None,
             state_indices: list[Any] | None, types: list[str]) -> None:
        arr = from_token_zero(pages, self.skip)
        self.skip = 0
        self.chunks += 1
        state = None
        if last:
            if aux_index is None:
                raise ValueError("the last chunk carries no metadata row")
            state = prefill_state(types, state_indices, aux_index)
        self.sender.send(arr, state, last=last)


def _metric(f: Figures | None) -> KVTransferMetric:
    if f is None or not f.success:
        return KVTransferMetric()
    return KVTransferMetric(transfer_latency_s=f.transfer_seconds,
                            transfer_total_bytes=f.nbytes)


class KvhandoffKVSender(CommonKVSender):  # type: ignore[misc]
    """One request on one prefill rank (see the module docstring)."""

    supports_host_tensor_indices = False  # host page ids: no pinned tensor, no CUDA event
    conclude_state: int | None

    def __init__(self, mgr: KvhandoffKVManager, bootstrap_addr: str, bootstrap_room: int,
                 req_has_disagg_prefill_dp_rank: bool = False) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room, req_has_disagg_prefill_dp_rank)
        self.kvh = Sender(as_prefill(mgr.agent), bootstrap_room,
                          key=mgr.request_key(bootstrap_room))
        self._out = mgr.senders[bootstrap_room] = _Outgoing(self.kvh)
        self._figures: Figures | None = None

    def pop_decode_prefix_len(self) -> int:
        return self.kvh.decode_prefix_len or 0

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        super().init(num_kv_indices, aux_index)
        prefix = self.kvh.decode_prefix_len or 0
        self._out.skip = prefix_pages(prefix, self.kv_mgr.kv_args.page_size)
        self.kvh.init(self._out.skip + num_kv_indices, aux_index)

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        state = kvpoll(self.kvh)
        if state == BOOTSTRAPPING and self.kvh.decode_prefix_len is not None:
            # decode's indices are in: SGLang learns the prefix and calls init, which
            # kvhandoff waits for before it calls the request bootstrapped
            return WAITING
        if state in FINAL:
            self.conclude_state = state
            self._figures = figures("prefill", self.kvh)
        if self._out.chunks == 0:
            return held_in_bootstrap(state, self.kvh.status is Status.FAILED)
        return state

    @property
    def figures(self) -> Figures | None:
        """The handoff's figures once it ended (None before): what
        :meth:`get_transfer_metric` reports, with kvhandoff's bytes per component."""
        return self._figures

    def get_transfer_metric(self) -> KVTransferMetric:
        return _metric(self._figures)

    def failure_exception(self) -> None:
        self.conclude_state = FAILED
        self.clear()
        raise KVTransferError(self.bootstrap_room, self.kvh.reason or "kvhandoff: failed")

    def abort(self) -> None:
        """Fail the request here and tell decode; no chunk of it goes out any more (the
        scheduler may drop an aborted request without clearing it)."""
        self.kvh.abort("aborted by SGLang (AbortReq)")
        self.kv_mgr.senders.pop(self.bootstrap_room, None)

    def clear(self) -> None:
        super().clear()
        self.kv_mgr.senders.pop(self.bootstrap_room, None)


class KvhandoffKVReceiver(CommonKVReceiver):  # type: ignore[misc]
    """One request on one decode rank (see the module docstring)."""

    conclude_state: int | None

    def __init__(self, mgr: KvhandoffKVManager, bootstrap_addr: str,
                 bootstrap_room: int | None = None) -> None:
        super().__init__(mgr, bootstrap_addr, bootstrap_room)
        self.kvh: Receiver | None = None
        self.bootstrap_infos: list[dict[str, Any]] = []  # SGLang's peers: kvhandoff's here
        self._metadata = False
        self._refusal = mgr.refusals.get(bootstrap_addr)

    def init(self, prefill_dp_rank: int) -> None:
        if self.conclude_state == FAILED:
            return
        if self._refusal is not None:
            self.kv_mgr.record_failure(self.bootstrap_room, self._refusal)
            self.conclude_state = FAILED
            return
        self.kvh = Receiver(as_decode(self.kv_mgr.agent), registry_url(self.bootstrap_addr),
                            self.bootstrap_room, dp_rank=prefill_dp_rank,
                            key=self.kv_mgr.request_key(self.bootstrap_room))

    def send_metadata(self, kv_indices: npt.ArrayLike, aux_index: int | None = None,
                      state_indices: list[Any] | None = None,
                      decode_prefix_len: int | None = None,
                      destination: KVTransferDestination = KVTransferDestination.DEVICE,
                      device_kv_indices: npt.ArrayLike | None = None) -> None:
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("kvhandoff's SGLang backend has no host KV destinations")
        if self.kvh is None or aux_index is None:
            return  # failed at init, or a dummy: poll says so
        indices = decode_indices(self.kv_mgr.types, np.asarray(kv_indices), state_indices,
                                 aux_index)
        self.kvh.init(indices, aux_index, decode_prefix_len=decode_prefix_len or 0)
        self._metadata = True

    def poll(self) -> int:
        if self.conclude_state is not None:
            return self.conclude_state
        if self.kvh is None:
            return BOOTSTRAPPING
        state = kvpoll(self.kvh)
        if not self._metadata and state in (BOOTSTRAPPING, WAITING):
            return WAITING  # takes its metadata at once
        if state in FINAL:
            self.conclude_state = state
        if not self._metadata:
            return held_in_bootstrap(state, self.kvh.status is Status.FAILED)
        return state

    def failure_exception(self) -> None:
        self.conclude_state = FAILED
        reason = self._refusal or (self.kvh.reason if self.kvh is not None else None)
        self.clear()
        raise KVTransferError(self.bootstrap_room, reason or "kvhandoff: failed")

    def abort(self) -> None:
        if self.kvh is not None:
            self.kvh.abort("aborted by SGLang (AbortReq)")
        else:
            self.conclude_state = FAILED
        self.abort_notified = True

    def ensure_abort_notified(self, *, force_arm: bool = False) -> None:
        """kvhandoff tells prefill of a failure itself (and waits for its AbortAck)."""
        self.abort_notified = True

    def is_abort_release_safe(self) -> bool:
        """No prefill write can land in this request's pages any more."""
        return self.kvh is None or self.kvh.released


class KvhandoffKVBootstrapServer(CommonKVBootstrapServer):  # type: ignore[misc]
    """SGLang's bootstrap server (``/route``, ``/health``, DP routes), also hosting
    kvhandoff's registry under ``/kvhandoff`` for the prefill agents."""

    def _setup_routes(self) -> None:
        super()._setup_routes()
        mount_registry(self.app, session_config(), host=self.host)
