"""Aux rows: one metadata row per request (first output token, optional logprobs and
hidden state), moved with the last chunk, with an arrival guard the session checks.

Row format, little-endian, ``AuxSpec.row_bytes`` long::

    [0:8)    guard      u64   hash of the request id; 0 = nothing landed   (session)
    [8:12)   crc32      u32   of bytes [16:row_bytes)                      (session)
    [12:16)  magic      u32   0x3148564B ("KVH1"): the header is ours      (session)
    [16:24)  first_token      i64                                          (engine)
    [24:28)  first_logprob    f32
    [28:32)  num_top          u32   entries used of ``top_logprobs``
    [32: )   top token ids    i64 × top_logprobs
             top logprobs     f32 × top_logprobs
             hidden state     ``hidden_bytes`` bytes
             zero padding to a multiple of 8

The engine fills the row on prefill with :meth:`AuxSpec.pack` before the last
``Sender.send``; the sender then :func:`stamp`\\ s the guard and the crc. Decode
:func:`clear`\\ s its row's header before asking for the request, and succeeds only when
:func:`check` finds the request's own guard and a matching crc (the guard detects a row
that has not landed yet or holds another request; the crc a torn row). Layouts built
elsewhere (e.g. :func:`kvhandoff.lab.shapes.layout_for`) work as long as rows are at least
16 bytes; the session only touches the header.
"""

from __future__ import annotations

import enum
import hashlib
import struct
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvhandoff.layout import NO_LAYER, Component, TensorSpec
from kvhandoff.protocol import RequestId
from kvhandoff.state_types import StateType

U8 = npt.NDArray[np.uint8]

HEADER_BYTES = 16
MAGIC = 0x3148564B  # b"KVH1" read as little-endian u32
_FIELDS_START = HEADER_BYTES


def request_guard(request_id: RequestId) -> int:
    """A non-zero 64-bit guard for ``request_id`` (``5`` and ``"5"`` differ)."""
    key = f"{type(request_id).__name__}:{request_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") | 1


class AuxState(enum.StrEnum):
    OK = "ok"  # this request's guard, crc matches (or the row is too small to check)
    EMPTY = "empty"  # guard 0: nothing landed yet
    OTHER = "other"  # another request's guard
    CORRUPT = "corrupt"  # our guard, but the crc does not match the row


_HEADER = struct.Struct("<QII")  # guard, crc32, magic
_GUARD = struct.Struct("<Q")


def stamp(row: U8, request_id: RequestId) -> None:
    """Write ``request_id``'s guard and the row's crc into its header (prefill, just
    before the last chunk is planned)."""
    guard = request_guard(request_id)
    if len(row) >= HEADER_BYTES:
        crc = zlib.crc32(row[HEADER_BYTES:].tobytes())
        row[:HEADER_BYTES] = np.frombuffer(_HEADER.pack(guard, crc, MAGIC), np.uint8)
    elif len(row) >= 8:
        row[0:8] = np.frombuffer(_GUARD.pack(guard), np.uint8)


def clear(row: U8) -> None:
    """Zero the header (decode, before sending the request's TransferInit), so a guard
    found later was written for this request."""
    row[:min(len(row), HEADER_BYTES)] = 0


def check(row: U8, request_id: RequestId) -> tuple[AuxState, str]:
    """Whether ``request_id``'s aux row has landed intact, and if not, what was found."""
    if len(row) < 8:
        return AuxState.OK, "row too small for a guard"
    whole = len(row) >= HEADER_BYTES
    if whole:
        found, stored, magic = _HEADER.unpack(row[:HEADER_BYTES].tobytes())
    else:
        (found,), magic = _GUARD.unpack(row[:8].tobytes()), 0
    if found == 0:
        return AuxState.EMPTY, "guard is 0 (nothing landed)"
    want = request_guard(request_id)
    if found != want:
        return AuxState.OTHER, f"guard {found:#018x}, expected {want:#018x}"
    if whole and magic == MAGIC:
        crc = zlib.crc32(row[HEADER_BYTES:].tobytes())
        if crc != stored:
            return AuxState.CORRUPT, f"crc32 {crc:#010x} of the row, header says {stored:#010x}"
    return AuxState.OK, ""


@dataclass(frozen=True, slots=True)
class AuxRecord:
    """What an aux row carries for the engine."""

    first_token: int
    first_logprob: float = 0.0
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()
    hidden: bytes = b""


@dataclass(frozen=True, slots=True, kw_only=True)
class AuxSpec:
    """The aux row format: how many top logprobs and how many hidden-state bytes."""

    top_logprobs: int = 0
    hidden_bytes: int = 0

    def __post_init__(self) -> None:
        if self.top_logprobs < 0 or self.hidden_bytes < 0:
            raise ValueError(f"AuxSpec needs top_logprobs >= 0 and hidden_bytes >= 0, got "
                             f"{self.top_logprobs}, {self.hidden_bytes}")

    @property
    def _ids_at(self) -> int:
        return _FIELDS_START + 16

    @property
    def _lps_at(self) -> int:
        return self._ids_at + 8 * self.top_logprobs

    @property
    def _hidden_at(self) -> int:
        return self._lps_at + 4 * self.top_logprobs

    @property
    def row_bytes(self) -> int:
        end = self._hidden_at + self.hidden_bytes
        return -(-end // 8) * 8

    def tensor(self, *, ptr: int, num_rows: int, name: str = "aux") -> TensorSpec:
        """The aux tensor of ``num_rows`` rows at ``ptr`` (replicated, no layer)."""
        return TensorSpec(name=name, layer_id=NO_LAYER, ptr=ptr, nbytes=num_rows * self.row_bytes,
                          item_bytes=self.row_bytes)

    def component(self, *, ptr: int, num_rows: int, name: str = "aux") -> Component:
        """The AUX component holding :meth:`tensor` (add it to a Layout's components)."""
        return Component(type=StateType.AUX, name=name,
                         tensors=(self.tensor(ptr=ptr, num_rows=num_rows),))

    def allocate(self, num_rows: int, *, name: str = "aux") -> tuple[U8, Component]:
        """A zeroed host buffer of ``num_rows`` rows and the component describing it."""
        buf = np.zeros(num_rows * self.row_bytes, np.uint8)
        return buf, self.component(ptr=int(buf.ctypes.data), num_rows=num_rows, name=name)

    def pack(self, row: U8, *, first_token: int, first_logprob: float = 0.0,
             top_ids: npt.ArrayLike | None = None, top_logprobs: npt.ArrayLike | None = None,
             hidden: bytes | npt.ArrayLike | None = None) -> None:
        """Write the engine's fields into one row (a uint8 view of ``row_bytes`` or more).
        Leaves the header alone: the sender stamps it."""
        if len(row) < self.row_bytes:
            raise ValueError(f"aux row of {len(row)} B is smaller than the spec's "
                             f"{self.row_bytes} B")
        ids = np.asarray(top_ids if top_ids is not None else [], dtype="<i8").reshape(-1)
        lps = np.asarray(top_logprobs if top_logprobs is not None else [],
                         dtype="<f4").reshape(-1)
        if len(ids) != len(lps) or len(ids) > self.top_logprobs:
            raise ValueError(f"top_ids ({len(ids)}) and top_logprobs ({len(lps)}) must have "
                             f"equal length, at most {self.top_logprobs}")
        raw = (np.frombuffer(hidden, np.uint8) if isinstance(hidden, bytes | bytearray)
               else np.asarray(hidden if hidden is not None else [], np.uint8).reshape(-1))
        if len(raw) > self.hidden_bytes:
            raise ValueError(f"hidden state of {len(raw)} B exceeds the spec's "
                             f"{self.hidden_bytes} B")
        body = row[_FIELDS_START:self.row_bytes]
        body[:] = 0
        body[0:8] = np.frombuffer(np.int64(first_token).astype("<i8").tobytes(), np.uint8)
        body[8:12] = np.frombuffer(np.float32(first_logprob).astype("<f4").tobytes(), np.uint8)
        body[12:16] = np.frombuffer(np.uint32(len(ids)).astype("<u4").tobytes(), np.uint8)
        row[self._ids_at:self._ids_at + 8 * len(ids)] = np.frombuffer(ids.tobytes(), np.uint8)
        row[self._lps_at:self._lps_at + 4 * len(lps)] = np.frombuffer(lps.tobytes(), np.uint8)
        row[self._hidden_at:self._hidden_at + len(raw)] = raw

    def unpack(self, row: U8) -> AuxRecord:
        """Read the engine's fields back (decode, after the request succeeded)."""
        if len(row) < self.row_bytes:
            raise ValueError(f"aux row of {len(row)} B is smaller than the spec's "
                             f"{self.row_bytes} B")
        first = int(row[16:24].view("<i8")[0])
        lp = float(row[24:28].view("<f4")[0])
        n = min(int(row[28:32].view("<u4")[0]), self.top_logprobs)
        ids = row[self._ids_at:self._ids_at + 8 * n].view("<i8")
        lps = row[self._lps_at:self._lps_at + 4 * n].view("<f4")
        hidden = row[self._hidden_at:self._hidden_at + self.hidden_bytes].tobytes()
        return AuxRecord(first_token=first, first_logprob=lp,
                         top_ids=tuple(int(i) for i in ids),
                         top_logprobs=tuple(float(v) for v in lps), hidden=hidden)


Allocate = Callable[[int], U8]
"""``allocate(nbytes)``: zeroed host memory peers may write into (a transport's
``allocate`` where it insists on its own memory), as uint8."""


class AuxRows:
    """``num_rows`` aux rows, each leased by one request from start to finish
    (:meth:`take`, then :meth:`give`): the one aux-row pool. :class:`AuxPool` adds the
    memory; an engine whose own pools hold the aux tensor (the reference engine) leases
    its row numbers from this alone.

    Thread-safe (one lock): an engine may lease on its scheduler thread and return rows
    from a polling thread. A row given back twice, or never leased, raises ``ValueError``
    rather than corrupting the pool."""

    def __init__(self, num_rows: int) -> None:
        if num_rows < 1:
            raise ValueError(f"an aux pool needs at least one row, got {num_rows}")
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._leased: set[int] = set()
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """Lease a free row, or None when every row is leased."""
        with self._lock:
            if not self._free:
                return None
            row = self._free.pop()
            self._leased.add(row)
        return row

    def give(self, row: int) -> None:
        """Return a leased row."""
        with self._lock:
            if row not in self._leased:
                raise ValueError(f"aux row {row} is not leased (given back twice, or "
                                 f"never taken from this pool of {self.num_rows})")
            self._leased.discard(row)
            self._free.append(row)

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._leased)


class AuxPool(AuxRows):
    """:class:`AuxRows` with their memory: ``num_rows`` rows of ``spec``'s format in a
    buffer it owns (from ``allocate`` when given, else a plain zeroed array), and the AUX
    :attr:`component` that describes it for a Layout. A row is handed out with its header
    cleared."""

    def __init__(self, num_rows: int, spec: AuxSpec | None = None, *,
                 allocate: Allocate | None = None, name: str = "aux") -> None:
        super().__init__(num_rows)
        self.spec = spec if spec is not None else AuxSpec()
        size = num_rows * self.spec.row_bytes
        self.buffer: U8 = np.zeros(size, np.uint8) if allocate is None else allocate(size)
        if len(self.buffer) < size:
            raise ValueError(f"allocate({size}) returned {len(self.buffer)} bytes")
        self.component = self.spec.component(ptr=int(self.buffer.ctypes.data),
                                              num_rows=num_rows, name=name)

    def take(self) -> int | None:
        """Lease a free row (its header cleared), or None when every row is leased."""
        row = super().take()
        if row is not None:
            clear(self.row(row))
        return row

    def row(self, row: int) -> U8:
        """A writable view of row ``row``."""
        if not 0 <= row < self.num_rows:
            raise IndexError(f"aux row {row} is outside the pool's {self.num_rows} rows")
        n = self.spec.row_bytes
        return self.buffer[row * n:(row + 1) * n]
