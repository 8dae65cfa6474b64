"""Faults through real SGLang servers over the ``kvhandoff`` backend (``.venv-sglang``).

One Llama deployment of its own (a test kills its decode server). Each fault is staged
without a race: the request goes to decode first (with its room, as a router would
send it), and only once decode's census shows it waiting for its KV (its indices sent
to prefill, which holds them until the request arrives there) does the fault happen —
the client aborts it on decode, or decode's whole process group is SIGKILLed — and only
then is the request sent to prefill. So prefill's Sender meets the fault as it starts:

* the other side fails with a reason SGLang hands its client (``finish_reason``);
* nothing stays live: prefill's KV pages, request slots and metadata rows are free, no
  queue holds a request, kvhandoff's live-request gauge is 0 (:mod:`~kvhandoff.lab.
  sglang.census`, read from inside the scheduler; a bounded wait, as prefill settles the
  failure on its own thread);
* the survivor serves the next request with the same tokens as before the fault
  (``test_sglang.py`` holds those to the colocated server's).

The negative control: prefill's kvhandoff transport is the lab's ``tcp-flip-armed``
(:class:`~kvhandoff.lab.testing.faulty.ArmedSourceFlippingTcp`, plain tcp until a file
arms it; so this deployment moves bytes over tcp, not ``auto``), and decode asks for
per-component checksums. Armed for one request, it flips one KV byte on the wire:
decode's checksum catches it and the request fails naming the component (caught by the
checksum, before any token; without checksums a flipped byte of a random-weight model's
KV need not change a greedy token, so tokens are no reliable witness).
"""

from __future__ import annotations

import json
import random
import threading
import time
import urllib.error
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvhandoff.lab.servers import post_json
from kvhandoff.lab.sglang import census
from kvhandoff.lab.sglang.client import abort, generate, request_body
from kvhandoff.lab.sglang.rig import Deployment, Extras
from kvhandoff.lab.sglang.rig import deployment as start_deployment
from kvhandoff.lab.testing.sglang import MAX_NEW_TOKENS, prompts, sglang_or_skip

pytestmark = pytest.mark.sglang

SETTLE_S = 120.0  # bounded waits for a server's own threads (never asserted on as time)
PROMPT = prompts()["p300"]


@pytest.fixture(scope="module")
def armed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file whose presence makes prefill's transport flip a byte."""
    return tmp_path_factory.mktemp("flip") / "armed"


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory, armed: Path) -> Iterator[Deployment]:
    extras = Extras(
        prefill_env={"KVHANDOFF_TRANSPORT": "tcp-flip-armed",
                     "KVHANDOFF_TRANSPORT_OPTIONS": json.dumps({"armed": str(armed)})},
        decode_env={"KVHANDOFF_TRANSPORT": "tcp", "KVHANDOFF_CHECKSUM": "1"},
        shims=("flip_transport",))
    with start_deployment("llama", "kvhandoff", log_dir=tmp_path_factory.mktemp("faults"),
                          python=sglang_or_skip(), extras=extras) as d:
        yield d


@pytest.fixture(scope="module")
def before(pd: Deployment) -> tuple[int, ...]:
    """The deployment's tokens for the prompt before any fault."""
    return pd.send(PROMPT, max_new_tokens=MAX_NEW_TOKENS)[0].output_ids


def _until(what: str, check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + SETTLE_S
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {SETTLE_S:.0f} s: {what}")
        time.sleep(0.2)


def _post(url: str, body: dict[str, Any]) -> str:
    """``/generate``'s answer as text, whether SGLang answered 200 or an error, or why
    none came (a killed server's client loses its connection)."""
    try:
        return str(post_json(url.rstrip("/") + "/generate", body, timeout=SETTLE_S))
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}: {e.msg}"
    except OSError as e:
        return f"no answer: {e!r}"


def _stage(pd: Deployment, rid: str) -> tuple[dict[str, Any], threading.Thread]:
    """Send the request to decode alone and return once decode waits for its KV."""
    room = pd.prefill.bootstrap(random.Random(rid).getrandbits(62))
    body = request_body(PROMPT, max_new_tokens=MAX_NEW_TOKENS, bootstrap=room, rid=rid)
    to_decode = threading.Thread(target=_post, args=(pd.decode.url, body), daemon=True)
    to_decode.start()
    _until("decode waits for the request's KV",
           lambda: census.read(pd.decode.url).queues["decode_transfer"] == 1)
    return body, to_decode


def _prefill_fails_and_frees(pd: Deployment, body: dict[str, Any], words: str) -> None:
    got = _post(pd.prefill.url, {**body, "rid": body["rid"] + "-prefill"})
    assert "KVTransferError" in got and words in got, got  # SGLang's answer, kvhandoff's reason
    _until("prefill holds nothing", lambda: census.read(pd.prefill.url).idle)


def _serves(pd: Deployment, want: tuple[int, ...]) -> None:
    """The next request, with a fresh room straight to both servers, gets ``want``."""
    room = pd.prefill.bootstrap(random.getrandbits(62))
    got: dict[str, Any] = {}
    t = threading.Thread(target=lambda: got.update(generate(
        pd.prefill.url, PROMPT, max_new_tokens=MAX_NEW_TOKENS, bootstrap=room)))
    t.start()
    out = generate(pd.decode.url, PROMPT, max_new_tokens=MAX_NEW_TOKENS, bootstrap=room)
    t.join(SETTLE_S)
    assert tuple(out["output_ids"]) == want


def test_a_client_abort_on_decode_fails_prefill_and_leaks_nothing(
        pd: Deployment, before: tuple[int, ...]) -> None:
    body, to_decode = _stage(pd, "kvh-fault-abort")
    abort(pd.decode.url, body["rid"])
    to_decode.join(SETTLE_S)
    _until("decode holds nothing", lambda: census.read(pd.decode.url).idle)
    _prefill_fails_and_frees(pd, body, "aborted by decode")
    _serves(pd, before)


def test_a_killed_decode_fails_prefill_and_leaks_nothing(
        pd: Deployment, before: tuple[int, ...]) -> None:
    body, _ = _stage(pd, "kvh-fault-kill")
    pd.decode.kill()
    _prefill_fails_and_frees(pd, body, "data connection was lost")
    pd.decode.start()  # a new decode process on the same ports: prefill serves it
    pd.decode.wait_ready(SETTLE_S * 5)
    _serves(pd, before)


def test_one_byte_flipped_on_the_wire_is_caught_by_decodes_checksums(
        pd: Deployment, before: tuple[int, ...], armed: Path) -> None:
    armed.touch()
    try:
        got = _post(pd.url, request_body(PROMPT, max_new_tokens=MAX_NEW_TOKENS))
    finally:
        armed.unlink()
    assert "crc32" in got and "component 'kv'" in got, got
    for srv in (pd.decode, pd.prefill):
        _until(f"{srv.name} holds nothing", lambda srv=srv: census.read(srv.url).idle)
    _serves(pd, before)
