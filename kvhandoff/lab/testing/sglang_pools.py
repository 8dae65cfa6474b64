"""One SGLang rank's side of a handoff through the ``kvhandoff`` backend, on SGLang's own
memory pools built on CPU (lab only; run with SGLang's interpreter, ``.venv-sglang``).

``python -m kvhandoff.lab.testing.sglang_pools CASES_JSON`` imports SGLang once and forks
one process per rank (a :class:`Case`), which runs as SGLang's scheduler would: it
publishes the rank's
server arguments, builds the family's real pools (``MHATokenToKVPool``,
``MLATokenToKVPool``, ``SWAKVPool``, ``MambaPool`` in a ``HybridLinearKVPool``,
``DSATokenToKVPool``) and metadata buffers, fills ``KVArgs`` from them with SGLang's own
functions, makes the backend's manager (prefill rank 0 also runs the bootstrap server),
and drives a Sender or a Receiver through SGLang's calls. It leaves its
:class:`Result` in the shared directory (:func:`run_handoff` collects them).

Prefill fills every byte it registers with a pattern of (rank, tensor, offset), identical
across ranks for replicated tensors, and writes its layout where decode finds it. Decode,
once the request succeeded, asks kvhandoff's naive oracle which source byte each of its
bytes must hold, and checks every one of them, and that no other byte changed (the aux
guard, which the session itself verifies, aside). Then it flips one received byte and
checks that the comparison finds exactly that byte: the check cannot pass vacuously.
"""

from __future__ import annotations

import importlib
import logging
import os
import subprocess
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt

__all__ = ["REPO_ROOT", "SCENARIOS", "Case", "Result", "main", "run_handoff", "sglang_python",
           "write_model"]

REPO_ROOT = Path(__file__).resolve().parents[3]


def sglang_python() -> Path:
    """The interpreter that has SGLang: ``$KVHANDOFF_SGLANG_PYTHON``, else this
    checkout's ``.venv-sglang/bin/python`` (``make sglang-venv``)."""
    env = os.environ.get("KVHANDOFF_SGLANG_PYTHON")
    return Path(env) if env else REPO_ROOT / ".venv-sglang" / "bin" / "python"

I64 = npt.NDArray[np.int64]


class Case(msgspec.Struct, frozen=True, kw_only=True):
    """One rank of one handoff."""

    family: str  # mha, mla, swa, mamba, dsa
    role: str  # prefill, decode
    tp_rank: int
    tp_size: int
    port: int  # SGLang's bootstrap port
    room: int
    work: str  # a directory both sides share (model config, layouts)
    prefill_tp: int = 1
    prefix: int = 0  # decode's prefix, tokens (a whole number of pages)
    flip: bool = False  # prefill: flip a source byte on the wire (SourceFlippingTcp)
    scenario: str = "ok"  # see SCENARIOS
    decode_head_dim: int = 16  # decode's pool (another size: a pair that must be refused)
    env: dict[str, str] = {}  # this rank's environment beside the launcher's
    timeout: float = 120.0


class Result(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    tp_rank: int
    status: int  # the final KVPoll
    reason: str = ""
    checked: int = 0  # decode: bytes compared with the oracle
    wrong: int = 0  # ... that differed
    untouched_changed: int = 0  # ... bytes outside the request that changed
    flipped_found: int = -1  # after flipping one received byte: mismatches found
    metric_bytes: int | None = None  # prefill: get_transfer_metric's bytes
    live: int = -1  # the agent's live requests after the request was cleared
    counted: float = 0.0  # kvhandoff's own metrics: this role's successful requests
    keyed: bool = False  # prefill: its kvhandoff Sender carried a request key


# --- the families: pools and each side's index lists -----------------------------------

PAGE = {"dsa": 64}  # tokens per page (others: 4)
FAMILY_STATE = {"mha": (), "mla": (), "swa": ("swa",), "mamba": ("mamba",), "dsa": ("dsa",)}


def _pools(family: str, tp: int, head_dim: int = 16) -> tuple[Any, bool]:
    """The family's token-to-KV pool on CPU for one rank of ``tp``, and whether it is MLA."""
    import sglang.srt.mem_cache.memory_pool as mp
    import torch
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    bf16, heads = torch.bfloat16, max(1, 2 // tp)
    if family == "mha":
        return mp.MHATokenToKVPool(size=64, page_size=4, dtype=bf16, head_num=heads,
                                   head_dim=head_dim, layer_num=2, device="cpu",
                                   enable_memory_saver=False), False
    if family == "mla":
        return mp.MLATokenToKVPool(size=64, page_size=4, dtype=bf16, kv_lora_rank=32,
                                   qk_rope_head_dim=16, layer_num=2, device="cpu",
                                   enable_memory_saver=False), True
    if family == "swa":
        return SWAKVPool(size=64, size_swa=32, page_size=4, dtype=bf16, head_num=heads,
                         head_dim=16, swa_attention_layer_ids=[0, 1],
                         full_attention_layer_ids=[2], device="cpu",
                         enable_memory_saver=False), False
    if family == "mamba":  # NemotronH-like: Mamba2 layer 0 (x 64, 1 group of 16), attention 2
        shape = Mamba2StateShape.create(tp_world_size=tp, intermediate_size=64, n_groups=1,
                                        num_heads=4, head_dim=16, state_size=16, conv_kernel=4)
        mamba = mp.MambaPool(size=8, spec_state_size=0, mamba_layer_ids=[0], device="cpu",
                             cache_params=Mamba2CacheParams(shape=shape, layers=[0]))
        return mp.HybridLinearKVPool(size=64, dtype=bf16, page_size=4, head_num=heads,
                                     head_dim=16, full_attention_layer_ids=[2], device="cpu",
                                     mamba_pool=mamba), False
    assert family == "dsa"
    return mp.DSATokenToKVPool(size=256, page_size=64, kv_lora_rank=32, dtype=bf16,
                               qk_rope_head_dim=16, layer_num=2, device="cpu",
                               index_head_dim=128, enable_memory_saver=False,
                               kv_cache_dim=48), True


def lists(family: str, role: str, prefix: int) -> tuple[list[int], list[list[int] | None], int]:
    """One side's KV pages (past decode's prefix), state entries and metadata row: chosen
    apart on each side, as two schedulers' allocators would."""
    skip = prefix // PAGE.get(family, 4)
    if family == "dsa":
        kv = [2, 3] if role == "prefill" else [4, 1]
    else:
        kv = [5, 2, 9][skip:] if role == "prefill" else [7, 11, 3][skip:]
    state: dict[str, list[int]] = {
        "swa": [3, 1] if role == "prefill" else [6, 2],
        "mamba": [3] if role == "prefill" else [5],
        "dsa": kv}
    return kv, [state[t] for t in FAMILY_STATE[family]], 2 if role == "prefill" else 6


# --- SGLang: publish a rank, fill KVArgs, make the manager ------------------------------


def write_model(work: Path) -> None:
    """The model config both sides serve (``config.json`` only: no weights are loaded):
    a tiny Llama whose config also names the Mamba2 pool's groups and state size, as a
    NemotronH config does, so the backend can tell its conv's sub-blocks."""
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 3, "vocab_size": 512, "max_position_embeddings": 512,
           "torch_dtype": "bfloat16", "rms_norm_eps": 1e-6, "head_dim": 16,
           "mamba_n_groups": 1, "ssm_state_size": 16}
    work.mkdir(parents=True, exist_ok=True)
    (work / "config.json").write_text(msgspec.json.encode(cfg).decode())


def _publish(case: Case) -> Any:
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    sa = ServerArgs(model_path=case.work, device="cpu", disaggregation_mode=case.role,
                    disaggregation_transfer_backend="kvhandoff", tp_size=case.tp_size,
                    disaggregation_bootstrap_port=case.port, skip_tokenizer_init=True,
                    attention_backend="torch_native", host="127.0.0.1",
                    page_size=PAGE.get(case.family, 4))
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=case.tp_rank, gpu_id=0))
    get_parallel().override_permanently(pp_group=None)  # no process groups here: PP 1
    return sa


def _kv_args(pool: Any, metadata: Any, rank: int, mla: bool, prefill: bool) -> Any:
    """``KVArgs`` as the scheduler fills them (``prefill.py`` / ``decode.py``
    ``_init_kv_manager``: decode's name no KV heads)."""
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.utils import (
        build_kv_layer_ids,
        get_kv_transfer_buf_infos,
        get_pd_kv_layout,
        setup_state_kv_args,
    )

    a = KVArgs()
    a.engine_rank, a.pp_rank, a.system_dp_rank, a.rust_http_port = rank, 0, 0, None
    a.kv_cache_dtype_str, a.kv_layout = "auto", get_pd_kv_layout(pool)
    a.prefill_start_layer, a.prefill_end_layer = pool.start_layer, getattr(pool, "end_layer", None)
    a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = get_kv_transfer_buf_infos(pool)
    a.num_draft_entries = 0
    a.kv_layer_ids = build_kv_layer_ids(token_to_kv_pool=pool, draft_token_to_kv_pool=None,
                                        num_draft_entries=0, num_hidden_layers=3)
    if prefill and not mla:
        a.kv_head_num, a.total_kv_head_num = pool.head_num, 2
    a.page_size = pool.page_size
    a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = metadata.get_buf_infos()
    a.ib_device, a.gpu_id = None, 0
    setup_state_kv_args(a, pool, None, 3, req_to_token_pool=None)
    return a


def _manager(case: Case, sa: Any) -> tuple[Any, Any, Any]:
    """(manager, pool, metadata buffers) of this rank; prefill rank 0 also starts the
    bootstrap server first (as SGLang's tokenizer manager does, beside the schedulers)."""
    import torch
    from sglang.srt.disaggregation.utils import (
        DisaggregationMode,
        KVClassType,
        MetadataBuffers,
        TransferBackend,
        get_kv_class,
    )

    backend = TransferBackend("kvhandoff")
    server = None
    if case.role == "prefill" and case.tp_rank == 0:
        server = get_kv_class(backend, KVClassType.BOOTSTRAP_SERVER)(host="127.0.0.1",
                                                                     port=case.port)
    pool, mla = _pools(case.family, case.tp_size,
                       case.decode_head_dim if case.role == "decode" else 16)
    metadata = MetadataBuffers(8, hidden_size=64, hidden_states_dtype=torch.bfloat16,
                               max_sampling_mask_tokens=16)
    mode = DisaggregationMode.PREFILL if case.role == "prefill" else DisaggregationMode.DECODE
    mgr = get_kv_class(backend, KVClassType.MANAGER)(
        _kv_args(pool, metadata, case.tp_rank, mla, case.role == "prefill"), mode, sa, mla)
    return mgr, (pool, metadata), server


# --- the byte pattern and the oracle check ---------------------------------------------


def _key(name: str, layer: int, rank: int) -> int:
    return zlib.crc32(f"{rank}:{name}:{layer}".encode()) & 0xFF


def pattern(offsets: I64, key: int) -> npt.NDArray[np.uint8]:
    """The byte at ``offsets`` of a tensor whose key is ``key``."""
    return ((offsets * 131 + key * 7) % 251 + 1).astype(np.uint8)


def _checked(layout: Any) -> list[Any]:
    return [t for c in layout.components if c.name != "aux" for t in c.tensors if t.nbytes]


def fill(layout: Any, rank: int) -> None:
    """Prefill: the pattern into every registered byte (replicated tensors: rank 0's)."""
    from kvhandoff.memory import raw_view

    for t in _checked(layout):
        r = rank if t.shard is not None else 0
        raw_view(t.ptr, t.nbytes)[:] = pattern(np.arange(t.nbytes, dtype=np.int64),
                                               _key(t.name, t.layer_id, r))


def _source_bytes(srcs: list[Any], layout_idx: I64, src: I64) -> npt.NDArray[np.uint8]:
    """What each (source layout, source address) holds under :func:`pattern`."""
    out = np.zeros(len(src), np.uint8)
    for li, lay in enumerate(srcs):
        mine = layout_idx == li
        tensors = sorted(_checked(lay), key=lambda t: t.ptr)
        starts = np.array([t.ptr for t in tensors], np.int64)
        which = np.searchsorted(starts, src[mine], side="right") - 1
        keys = np.array([_key(t.name, t.layer_id, lay.tp_rank if t.shard is not None else 0)
                         for t in tensors], np.int64)
        offs = src[mine] - starts[which]
        out[mine] = ((offs * 131 + keys[which] * 7) % 251 + 1).astype(np.uint8)
    return out


def compare(srcs: list[Any], dst: Any, request: Any) -> tuple[int, int, int]:
    """(bytes the oracle maps, of them wrong, other registered bytes not zero) on decode."""
    from kvhandoff.lab.testing.oracle import expected_writes
    from kvhandoff.memory import raw_view

    want = expected_writes(srcs, dst, request)
    expect = _source_bytes(srcs, want.layout, want.src)
    wrong = untouched = 0
    for t in _checked(dst):
        buf = raw_view(t.ptr, t.nbytes)
        inside = (want.dst >= t.ptr) & (want.dst < t.ptr + t.nbytes)
        offs = want.dst[inside] - t.ptr
        wrong += int(np.count_nonzero(buf[offs] != expect[inside]))
        others = np.ones(t.nbytes, bool)
        others[offs] = False
        untouched += int(np.count_nonzero(buf[others]))
    return len(want), wrong, untouched


def request_of(case: Case, srcs: list[Any], dst: Any) -> dict[str, Any]:
    """The request both sides made, for the oracle: each component's prefill and decode
    items (prefill's KV pages from token 0: its prefix pages are what decode skips)."""
    from kvhandoff.integrations.sglang.layout import component_name
    from kvhandoff.plan import Indices

    pkv, pstate, prow = lists(case.family, "prefill", 0)
    dkv, dstate, drow = lists(case.family, "decode", case.prefix)
    skip = case.prefix // PAGE.get(case.family, 4)
    types = list(FAMILY_STATE[case.family])
    req: dict[str, Any] = {c.name: None for c in dst.components}
    req["kv"] = Indices(pkv[skip:], dkv)
    for i, t in enumerate(types):
        p, d = pstate[i], dstate[i]
        if p is not None and d is not None:
            req[component_name(t, i, types)] = Indices(p, d)
    req["metadata"] = Indices([prow], [drow])
    return req


# --- the two sides ---------------------------------------------------------------------

SCENARIOS = ("ok", "decode_abort", "prefill_abort", "kill_decode", "kill_prefill",
             "prefill_silent", "foreign_key")
"""What a :class:`Case` does besides a plain handoff: one side aborts, dies (``os._exit``
once the other side's step is certain) or never sends; or decode claims the request
with the key of another room (an impostor holding the deployment secret)."""


def _wait(poll: Callable[[], int], until: tuple[int, ...], timeout: float) -> int:
    deadline = time.monotonic() + timeout
    state = poll()
    while state not in until and time.monotonic() < deadline:
        time.sleep(0.02)
        state = poll()
    return state


def _await_file(path: Path, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    return path.exists()


def _die(case: Case, what: str) -> None:
    """This side dies here, as a killed process would (no clean-up of any kind)."""
    Path(case.work, f"{what}.marker").touch()
    _ended_here(case)
    os._exit(3)


def _ended_here(case: Case) -> None:
    Path(case.work, f"ended-{case.role}{case.tp_rank}").touch()


def _all_ended(case: Case) -> None:
    """Wait until every rank of the handoff has its answer (or died): a side that closed
    its transport the moment it was done could cut off an acknowledgement the other side
    still awaits (decode learns of the last bytes in band, before prefill's write
    completes), and a real engine does not shut down between two requests."""
    work = Path(case.work)
    ranks = int((work / "ranks").read_text())
    deadline = time.monotonic() + case.timeout
    while len(list(work.glob("ended-*"))) < ranks and time.monotonic() < deadline:
        time.sleep(0.05)


def _ended(side: Any, state: int) -> tuple[str, int]:
    """The failure's reason ("" after a success), and the agent's live requests once the
    request was cleared (prefill: settled; decode: released): 0, nothing leaked."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    reason = ""
    if state == KVPoll.Failed:
        try:
            side.failure_exception()
        except Exception as e:
            reason = str(e)
    else:
        side.clear()
    agent = side.kv_mgr.agent
    deadline = time.monotonic() + 30
    while agent.live_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    return reason, agent.live_requests


def _counted(role: str) -> float:
    """Successful requests of ``role`` in kvhandoff's own metrics of this process."""
    from kvhandoff.observe.report import process_metrics

    return float(sum(  # over every transport label (auto names the one it picked)
        sample.value for family in process_metrics().registry.collect()
        for sample in family.samples
        if sample.name == "kvhandoff_requests_total" and sample.labels.get("role") == role
        and sample.labels.get("status") == "success"))


def _class(kind: str) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class

    return get_kv_class(TransferBackend("kvhandoff"), KVClassType[kind])


def run_prefill(case: Case, mgr: Any) -> Result:
    from sglang.srt.disaggregation.base.conn import KVPoll

    from kvhandoff.protocol import layout_to_msg

    fill(mgr.agent.layout, case.tp_rank)
    Path(case.work, f"prefill-{case.tp_rank}.layout").write_bytes(
        msgspec.msgpack.encode(layout_to_msg(mgr.agent.layout)))
    sender = _class("SENDER")(mgr, f"127.0.0.1:{case.port}", case.room)
    state = _wait(sender.poll, (KVPoll.WaitingForInput, KVPoll.Failed), case.timeout)
    if state == KVPoll.WaitingForInput:
        _step(case, sender)
        state = _wait(sender.poll, (KVPoll.Success, KVPoll.Failed), case.timeout)
    metric = sender.get_transfer_metric().transfer_total_bytes
    reason, live = _ended(sender, int(state))
    return Result(role="prefill", tp_rank=case.tp_rank, status=int(state), reason=reason,
                  metric_bytes=metric, live=live, counted=_counted("prefill"),
                  keyed=sender.kvh.key is not None)


def _step(case: Case, sender: Any) -> None:
    """Prefill once decode's indices are in: send, or what the scenario says."""
    if case.scenario == "prefill_abort":
        sender.abort()
        return
    if case.scenario == "kill_prefill":
        _die(case, "prefill")
    if case.scenario == "prefill_silent":
        return
    if case.scenario in ("decode_abort", "kill_decode"):  # send only once decode acted
        _await_file(Path(case.work, "decode.marker"), case.timeout)
    prefix = sender.pop_decode_prefix_len()
    kv, states, row = lists(case.family, "prefill", prefix)
    sender.init(len(kv), row)
    sender.send(np.asarray(kv, np.int32), states)


def run_decode(case: Case, mgr: Any) -> Result:
    from sglang.srt.disaggregation.base.conn import KVPoll

    addr = f"127.0.0.1:{case.port}"
    deadline = time.monotonic() + case.timeout
    while not mgr.try_ensure_parallel_info(addr) and time.monotonic() < deadline:
        time.sleep(0.2)
    if case.scenario == "foreign_key":  # derive the key of the next room, not this one's
        own = mgr.request_key
        mgr.request_key = lambda room: own(room + 1)
    receiver = _class("RECEIVER")(mgr, addr, case.room)
    receiver.init(0)
    state = _wait(receiver.poll, (KVPoll.WaitingForInput, KVPoll.Failed), case.timeout)
    if state == KVPoll.WaitingForInput:
        kv, states, row = lists(case.family, "decode", case.prefix)
        receiver.send_metadata(np.asarray(kv, np.int32), row, states,
                               decode_prefix_len=case.prefix)
        if case.scenario == "decode_abort":
            receiver.abort()
            Path(case.work, "decode.marker").touch()
        elif case.scenario == "kill_decode":
            time.sleep(1.0)  # the indices reach prefill first
            _die(case, "decode")
        state = _wait(receiver.poll, (KVPoll.Success, KVPoll.Failed), case.timeout)
    if state != KVPoll.Success:
        reason, live = _ended(receiver, int(state))
        return Result(role="decode", tp_rank=case.tp_rank, status=int(state), reason=reason,
                      live=live)
    result = _verify(case, mgr, int(state))
    _, live = _ended(receiver, int(state))
    return msgspec.structs.replace(result, live=live, counted=_counted("decode"))


def _verify(case: Case, mgr: Any, state: int) -> Result:
    from kvhandoff.memory import raw_view
    from kvhandoff.protocol import LayoutMsg, layout_from_msg

    srcs = [layout_from_msg(msgspec.msgpack.decode(
        Path(case.work, f"prefill-{r}.layout").read_bytes(), type=LayoutMsg))
        for r in range(case.prefill_tp)]
    dst = mgr.agent.layout
    req = request_of(case, srcs, dst)
    checked, wrong, untouched = compare(srcs, dst, req)
    kv = dst.component("kv").tensors[0]  # flip one byte decode received, and look again
    page = lists(case.family, "decode", case.prefix)[0][0]
    cell = raw_view(kv.ptr + page * kv.item_stride, 1)
    cell[0] ^= 0xFF
    found = compare(srcs, dst, req)[1]
    cell[0] ^= 0xFF
    return Result(role="decode", tp_rank=case.tp_rank, status=state, checked=checked,
                  wrong=wrong, untouched_changed=untouched, flipped_found=found)


def _prepare() -> None:
    """What every rank needs before its own work, done once in the launcher (its ranks
    are forked from it, so each skips importing torch and SGLang again)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    from kvhandoff.lab.testing.sglang_cpu import install

    install()
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvhandoff.integrations.sglang.plugin import register
    from kvhandoff.transport.registry import register_transport

    register()
    HookRegistry.apply_hooks()
    register_transport("tcp-flip", "kvhandoff.lab.testing.faulty:SourceFlippingTcp")
    for module in ("sglang.srt.disaggregation.common.conn", "sglang.srt.mem_cache.memory_pool",
                   "sglang.srt.mem_cache.swa_memory_pool", "sglang.srt.server_args"):
        importlib.import_module(module)


def run_rank(case: Case) -> Result:
    """One rank, in this process (prepared): publish, make the manager, hand off."""
    os.environ.update(case.env)
    if case.flip:
        os.environ["KVHANDOFF_TRANSPORT"] = "tcp-flip"
    sa = _publish(case)
    mgr, _keep, server = _manager(case, sa)
    try:
        result = (run_prefill if case.role == "prefill" else run_decode)(case, mgr)
        _ended_here(case)
        _all_ended(case)  # serve until every side has its answer
    finally:
        mgr.close()
        if server is not None:
            server.close()
    return result


def _fork(case: Case) -> int:
    """A child process running ``case``; its log and result go to files in ``work``."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        name = Path(case.work, f"{case.role}{case.tp_rank}")
        with open(f"{name}.log", "w") as log:
            os.dup2(log.fileno(), 2)
            logging.getLogger().handlers[0].setStream(sys.stderr)  # type: ignore[attr-defined]
            result = run_rank(case)
        Path(f"{name}.result").write_bytes(msgspec.json.encode(result))
        code = 0
    finally:
        os._exit(code)


def main(argv: list[str]) -> int:
    """``CASES_JSON``: prepare once, fork one process per rank (a list of :class:`Case`),
    wait for them."""
    cases = msgspec.json.decode(argv[0].encode(), type=list[Case])
    _prepare()
    if cases:
        Path(cases[0].work, "ranks").write_text(str(len(cases)))
    for pid in [_fork(c) for c in cases]:
        os.waitpid(pid, 0)
    return 0


# --- the driver (any interpreter): one handoff, its ranks forked from one launcher -------


def run_handoff(python: Path, root: Path, work: Path, *, family: str, prefill_tp: int = 1,
                decode_tp: int = 1, port: int, timeout: float = 120.0,
                env: dict[str, str] | None = None,
                decode_env: dict[str, str] | None = None, **case: Any
                ) -> dict[tuple[str, int], Result | None]:
    """Run one handoff: ``prefill_tp`` prefill ranks and ``decode_tp`` decode ranks, each a
    process forked by one ``python -m kvhandoff.lab.testing.sglang_pools`` launcher with
    this checkout (``root``) first on its path; ``case`` sets the rest of each
    :class:`Case`, ``decode_env`` decode's environment beside ``env``. Each rank's log
    goes to ``work``. Returns every rank's Result (None: it left none, e.g. killed on
    purpose)."""
    write_model(work)
    cases = [Case(family=family, role=role, tp_rank=r, tp_size=tp, port=port, room=4242,
                  work=str(work), prefill_tp=prefill_tp, timeout=timeout,
                  env=dict(decode_env or {}) if role == "decode" else {},
                  **{k: v for k, v in case.items() if role == "prefill" or k != "flip"})
             for role, tp in (("prefill", prefill_tp), ("decode", decode_tp))
             for r in range(tp)]
    launcher = subprocess.run(
        [str(python), "-m", "kvhandoff.lab.testing.sglang_pools",
         msgspec.json.encode(cases).decode()],
        env={**os.environ, "PYTHONPATH": str(root), "SGLANG_PLUGINS": "kvhandoff",
             "SGLANG_USE_CPU_ENGINE": "1", **(env or {})},
        capture_output=True, text=True, timeout=4 * timeout)
    (work / "launcher.log").write_text(launcher.stdout + launcher.stderr)
    out: dict[tuple[str, int], Result | None] = {}
    for c in cases:
        f = work / f"{c.role}{c.tp_rank}.result"
        out[(c.role, c.tp_rank)] = (msgspec.json.decode(f.read_bytes(), type=Result)
                                    if f.exists() else None)
    return out


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
