"""The connector's scheduler half: which requests hand off, and which blocks they use.

Prefill (``kv_producer``): a request that arrives with ``do_remote_decode`` is cut short by
:func:`~kvhandoff.integrations.vllm.requests.backoff` tokens (recurrent state must stop
one token early), and when it finishes its blocks stay allocated (``delay_free``) until
the worker reports the handoff over — success, failure or timeout alike. The response
carries ``kv_transfer_params`` naming the kvhandoff request, the bootstrap, a digest of
the prompt tokens the state belongs to, and the request's key (``kvh_key``, a fresh
:class:`~kvhandoff.binding.RequestKey`): the proxy hands these to the decode it routes
the request to, and only a decode that holds the key can claim the request's KV (any
other is refused before a byte moves). A proxy must pass ``kv_transfer_params`` on
untouched and to nobody else, as vLLM's own P/D proxies do.

Decode (``kv_consumer``): a request that arrives with those params (and a valid key) loads every
prompt token but the backed-off tail asynchronously (vLLM's ``WAITING_FOR_REMOTE_KVS``); once
vLLM allocated its blocks, the worker opens a Receiver into them. A decode request that
is aborted while its blocks may still be written keeps them (``delay_free``) until the
worker saw the receive released.

vLLM's objects are used duck-typed (``request.request_id``, ``prompt_token_ids``,
``kv_transfer_params``, ``status``; ``blocks.get_block_ids()``), so this half is tested
without vLLM.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvhandoff.integrations import RequestKey
from kvhandoff.integrations.vllm.requests import (
    GroupRule,
    RecvReq,
    SendReq,
    StepMeta,
    pick,
    prompt_digest,
)

log = logging.getLogger("kvhandoff.integrations.vllm")

FINISHED_OK = ("FINISHED_STOPPED", "FINISHED_LENGTH_CAPPED")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    producer: bool
    bootstrap: str
    instance: str
    rules: tuple[GroupRule, ...]
    transfer_groups: tuple[int, ...]  # indices into vLLM's kv_cache_groups
    backoff: int


@dataclass(slots=True)
class _Pending:
    """A decode request between get_num_new_matched_tokens and its allocation."""

    remote_id: str
    local_prefix: int
    num_tokens: int
    key: str  # the request's key, hex


class SchedulerSide:
    """See the module docstring. Called from vLLM's scheduler thread only."""

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self._meta = StepMeta()
        self._pending: dict[str, _Pending] = {}
        self._sending: set[str] = set()  # prefill: delay-freed, not yet reported finished
        self._receiving: set[str] = set()  # decode: sent to the worker, not yet finished

    # --- prefill ---------------------------------------------------------------------

    def on_new_request(self, request: Any) -> None:
        params = request.kv_transfer_params
        if not (self.cfg.producer and params and params.get("do_remote_decode")):
            return
        n = self.cfg.backoff
        if n and not params.get("kvh_truncated") and request.num_prompt_tokens > n:
            # vLLM's own connectors do the same cut; the fields are vLLM's request state
            del request.prompt_token_ids[-n:]
            del request._all_token_ids[-n:]
            request.num_prompt_tokens -= n
            params["kvh_truncated"] = True
        request.max_tokens = 1

    def request_finished(self, request: Any, block_ids: Sequence[Sequence[int]]
                         ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        rid = request.request_id
        if not params:
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if params.get("do_remote_prefill") is False and rid in self._receiving:
            if status == "FINISHED_ERROR":
                # vLLM fails a loading request only on the failed receive the worker just
                # reported, released: nothing of ours holds its blocks any more
                return False, None
            # decode: ended (aborted) while its receive may still write its blocks
            self._meta.aborts.append(rid)
            return True, None
        if not (self.cfg.producer and params.get("do_remote_decode")):
            return False, None
        if status not in FINISHED_OK:
            log.info("request %s ended %s before its handoff; nothing sent", rid, status)
            return False, None
        n = int(request.num_computed_tokens)
        groups = [block_ids[g] for g in self.cfg.transfer_groups]
        blocks = tuple(tuple(pick(r, b, start=0, end=n)) for r, b in
                       zip(self.cfg.rules, groups, strict=True))
        key = RequestKey.new()
        self._meta.sends.append(SendReq(request_id=rid, blocks=blocks, num_tokens=n,
                                        key=key.hex()))
        self._sending.add(rid)
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "kvh_request_id": rid,
            "kvh_bootstrap": self.cfg.bootstrap,
            "kvh_instance": self.cfg.instance,
            "kvh_num_tokens": n,
            "kvh_prompt": prompt_digest(request.prompt_token_ids or (), n),
            "kvh_key": key.hex(),
        }

    # --- decode ----------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Any, num_computed: int) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if self.cfg.producer or not params or not params.get("do_remote_prefill"):
            return 0, False
        rid = request.request_id
        why = self._refuse(params, request)
        if why:
            # the state on offer is not for these tokens: compute them here instead
            log.error("request %s: not loading prefill's state: %s", rid, why)
            params["do_remote_prefill"] = False
            return 0, False
        n = int(params["kvh_num_tokens"])
        count = n - num_computed
        if count <= 0:
            return 0, False
        self._pending[rid] = _Pending(str(params["kvh_request_id"]), num_computed, n,
                                      str(params["kvh_key"]))
        return count, True

    def _refuse(self, params: dict[str, Any], request: Any) -> str:
        if not isinstance(params.get("kvh_request_id"), str):
            return "kv_transfer_params carry no kvh_request_id (not from a kvhandoff prefill)"
        boot = params.get("kvh_bootstrap")
        if boot != self.cfg.bootstrap:
            return (f"kvh_bootstrap {boot!r} is not this decode's bootstrap "
                    f"{self.cfg.bootstrap!r}; decode dials only its own")
        n = params.get("kvh_num_tokens")
        prompt = request.prompt_token_ids or ()
        if not isinstance(n, int) or not 0 < n <= len(prompt) - self.cfg.backoff:
            return (f"kvh_num_tokens {n!r} does not fit a prompt of {len(prompt)} tokens "
                    f"(backoff {self.cfg.backoff})")
        if params.get("kvh_prompt") != prompt_digest(prompt, n):
            return "the prompt tokens differ from those prefill computed (digest mismatch)"
        try:
            RequestKey.from_hex(params.get("kvh_key"))
        except ValueError as e:
            return f"kv_transfer_params carry no usable kvh_key (the request's key): {e}"
        return ""

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        p = self._pending.pop(request.request_id, None)
        if p is None or num_external <= 0:
            return
        params = request.kv_transfer_params
        all_groups = blocks.get_block_ids()
        groups = [all_groups[g] for g in self.cfg.transfer_groups]
        mine = tuple(tuple(pick(r, b, start=p.local_prefix, end=p.num_tokens))
                     for r, b in zip(self.cfg.rules, groups, strict=True))
        self._meta.recvs.append(RecvReq(
            request_id=request.request_id, remote_id=p.remote_id, bootstrap=self.cfg.bootstrap,
            instance=str(params.get("kvh_instance") or self.cfg.instance), blocks=mine,
            prefix_tokens=p.local_prefix, num_tokens=p.num_tokens, key=p.key))
        self._receiving.add(request.request_id)
        params["do_remote_prefill"] = False  # a re-entry (preemption) does not load again

    # --- both ------------------------------------------------------------------------

    def build_meta(self) -> StepMeta:
        meta, self._meta = self._meta, StepMeta()
        return meta

    def update_finished(self, sending: Iterable[str] | None, recving: Iterable[str] | None
                        ) -> None:
        self._sending.difference_update(sending or ())
        self._receiving.difference_update(recving or ())
        self._receiving.difference_update(sending or ())

    @property
    def pending_push(self) -> bool:
        return bool(self._sending or self._meta.sends)
