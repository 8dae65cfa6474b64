"""Which transport a peer gets, between two processes anywhere (two network namespaces
included): a receiving and a sending process driven over stdin/stdout. Test support.

    python -m kvhandoff.lab.testing.pick receive NAME HOST NBYTES SEED
        prints ``ENDPOINT <hex> <base address>``; then answers a ``sha`` line with
        ``SHA <sha256 of its buffer>``; any other line ends it.
    python -m kvhandoff.lab.testing.pick send NAME HOST NBYTES SEED
        reads the receiver's ENDPOINT line, connects (``HOST``: where its own transport
        listens, for auto's tcp), prints ``VIA <transport the peer went through>``,
        writes a ``mixed`` plan into the receiver's buffer (whose initial bytes are
        ``noise(SEED)``), prints ``DONE <state>`` and ``WANT <sha256 the receiver's
        buffer must have now>``.

Every wait is bounded (60 s).
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import numpy as np

from kvhandoff.lab.testing.transport import PlanBuilder, bump, noise
from kvhandoff.transport import create_transport
from kvhandoff.transport.auto.transport import AutoPeer

TIMEOUT = 60.0


def _options(name: str, host: str) -> dict[str, Any]:
    return {"host": host} if name in ("auto", "tcp") else {}


def receive(name: str, host: str, nbytes: int, seed: int) -> None:
    with create_transport(name, **_options(name, host)) as t:
        buf = t.allocate(nbytes)
        buf[:] = noise(np.random.default_rng(seed), nbytes)
        print(f"ENDPOINT {t.endpoint().hex()} {int(buf.ctypes.data)}", flush=True)
        for line in sys.stdin:
            if line.strip() != "sha":
                break
            print(f"SHA {hashlib.sha256(buf.data).hexdigest()}", flush=True)


def send(name: str, host: str, nbytes: int, seed: int) -> None:
    _, ep_hex, base = sys.stdin.readline().split()
    mirror = noise(np.random.default_rng(seed), nbytes)
    with create_transport(name, **_options(name, host)) as t:
        def src(n: int) -> np.ndarray:
            a = np.empty(n, np.uint8)
            t.register(a)
            return a

        b = PlanBuilder(np.random.default_rng(seed + 1), src, bump(int(base), mirror))
        plan = b.plan("mixed")
        want = b.expected(plan)
        peer = t.connect(bytes.fromhex(ep_hex))
        print(f"VIA {peer.via if isinstance(peer, AutoPeer) else name}", flush=True)
        h = t.submit(peer, plan)
        print(f"DONE {t.wait(h, TIMEOUT).value} {h.error or ''}", flush=True)
        for (ptr, _), exp in zip(b.dsts, want, strict=True):
            mirror[ptr - int(base):ptr - int(base) + len(exp)] = exp
        print(f"WANT {hashlib.sha256(mirror.data).hexdigest()}", flush=True)
        peer.close()


def main(argv: list[str]) -> int:
    role, name, host, nbytes, seed = argv
    (receive if role == "receive" else send)(name, host, int(nbytes), int(seed))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
