"""Engine mistakes fail at the call, with the reason, before anything is sent."""

from __future__ import annotations

import numpy as np
import pytest

from kvhandoff.lab.testing.handoff import decode_lists, request_of
from kvhandoff.lab.testing.rig import Rig
from kvhandoff.session import Receiver, Sender, Status


def test_receiver_call_errors(rig: Rig) -> None:
    rp = rig.plan(1)
    lists, row = decode_lists(request_of(rig.scn, rp, rig.src, rig.dst), rig.dst)
    with pytest.raises(ValueError, match="a Receiver needs a decode agent"):
        Receiver(rig.prefill, rig.url, 1)
    with pytest.raises(TypeError, match="request_id"):
        Receiver(rig.decode, rig.url, (1, 2))  # type: ignore[arg-type]
    r = Receiver(rig.decode, rig.url, 1)
    with pytest.raises(ValueError, match="already live"):
        Receiver(rig.decode, rig.url, 1)
    with pytest.raises(ValueError, match=r"missing \['mamba'\]"):
        r.init({"kv": lists["kv"]}, row)
    with pytest.raises(ValueError, match="component 'kv': decode index 9999"):
        r.init({**lists, "kv": np.array([1, 9999])}, row)
    with pytest.raises(ValueError, match="aux_row"):
        r.init(lists, 10_000)
    r.init(lists, row)
    with pytest.raises(RuntimeError, match="twice"):
        r.init(lists, row)
    r.abort("done with the test")
    assert r.wait_released(5)


def test_sender_call_errors(rig: Rig) -> None:
    with pytest.raises(ValueError, match="a Sender needs a prefill agent"):
        Sender(rig.decode, 1)
    s = Sender(rig.prefill, 1)
    with pytest.raises(RuntimeError, match="before init"):
        s.send([1])
    with pytest.raises(ValueError, match="aux_row"):
        s.init(2)
    s.init(2, 1)
    with pytest.raises(ValueError, match="component 'kv': prefill index 5000"):
        s.send([5000])
    with pytest.raises(ValueError, match="with the last chunk only"):
        s.send([1], state_indices={"mamba": [1]})
    with pytest.raises(ValueError, match=r"missing \['mamba'\]"):
        s.send([1, 2], state_indices={}, last=True)
    s.send([1, 2], state_indices={"mamba": [1]}, last=True)
    with pytest.raises(RuntimeError, match="after the last chunk"):
        s.send([3])
    s.abort("done with the test")
    assert s.poll() is Status.FAILED and s.wait_settled(5)
