"""What the soak's parent and its workers say to each other over their pipes. Plain frozen
records (pickled by ``multiprocessing``); no I/O, so the checker can read them purely.

Parent → worker: :class:`WorkerSpec` (at spawn), :class:`Job` per request side, then
:data:`LEAKS`. Worker → parent: :class:`Ready` or :class:`Failed` once, an :class:`Ended`
per job (from the job's thread), and :class:`Leaks` last.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from kvhandoff.lab.soak.pattern import Geometry
from kvhandoff.lab.soak.plan import RequestSpec

LEAKS = "leaks"
"""The parent's last question: close the agents and answer :class:`Leaks`."""


def prefill_instance(worker: int, transport: str) -> str:
    """The bootstrap instance name of prefill worker ``worker``'s ranks on ``transport``."""
    return f"soak-p{worker}-{transport}"


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    role: str  # "prefill" or "decode"
    index: int
    url: str  # bootstrap server
    transports: tuple[str, ...]
    geometry: Geometry
    session: dict[str, Any] = field(default_factory=dict)  # SessionConfig overrides
    log_level: int = logging.ERROR  # the session's warnings (peer lost …) are expected here
    netns: str = ""  # run inside this network namespace (the link-cut pair)
    host: str = ""  # bind and advertise this address (control sockets, tcp transport)
    bootstrap_port: int = 0  # also serve a bootstrap server on host:port (the pair's prefill)


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    spec: RequestSpec
    prefill_block: int
    decode_block: int
    limit: float  # how long a side waits for a terminal status before calling it hung


@dataclass(frozen=True, slots=True, kw_only=True)
class Ready:
    role: str
    index: int
    pid: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Failed:
    role: str
    index: int
    error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Ended:
    """One side's end of one request. Times are ``time.monotonic()`` (system-wide on
    Linux, so the parent compares them with its own)."""

    rid: str
    role: str
    worker: int
    status: str  # "success", "failed", "hung" (not terminal within the job's limit)
    reason: str
    started: float
    ended: float  # after the status, the release (decode) or settling (prefill) too
    status_at: float = 0.0  # when the side's wait saw the status (0: never)
    settled: bool = True  # prefill: every write over; decode: pages released
    release_reason: str = ""
    checked_bytes: int = 0  # decode SUCCESS: bytes compared with the fill
    wrong_bytes: int = 0  # ... and how many differed
    flipped: bool = False  # prefill: a source byte was flipped after its chunk was submitted


@dataclass(frozen=True, slots=True, kw_only=True)
class Leaks:
    role: str
    index: int
    live_requests: int  # requests the agents still held before closing
    threads: list[str]  # kvh-* threads left after closing
    fds: int  # descriptors above the baseline after closing
    sockets: int  # socket descriptors above the baseline after closing
    request_threads: int  # soak request threads still running
