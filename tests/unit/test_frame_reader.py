"""The buffered frame reader: a frame that arrived whole costs one syscall (inside an
engine each syscall hands the GIL away), and whatever way the stream is cut, the frames
read are the frames sent — nothing lost, nothing borrowed from the next one."""

from __future__ import annotations

import socket
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvhandoff.transport.framing.io import FrameReader

HEAD = struct.Struct("<I")  # a stand-in header: the body's length


class Chunks:
    """A socket stand-in that hands out ``data`` in the given chunk sizes (then EOF,
    or a timeout when ``idle_at_end``)."""

    def __init__(self, data: bytes, cuts: list[int], idle_at_end: bool = False) -> None:
        self.data, self.cuts, self.pos = data, list(cuts), 0
        self.idle_at_end = idle_at_end

    def recv_into(self, view: memoryview) -> int:
        if self.pos >= len(self.data):
            if self.idle_at_end:
                raise TimeoutError("timed out")
            return 0
        n = min(len(view), self.cuts.pop(0) if self.cuts else len(self.data),
                len(self.data) - self.pos)
        view[:n] = self.data[self.pos:self.pos + n]
        self.pos += n
        return n


def frames(bodies: list[bytes]) -> bytes:
    return b"".join(HEAD.pack(len(b)) + b for b in bodies)


def read_all(reader: FrameReader, count: int) -> list[bytes]:
    out = []
    for _ in range(count):
        view = reader.header(HEAD.size, idle_ok=False)
        assert view is not None
        (n,) = HEAD.unpack(view)
        out.append(bytes(reader.exact(n)))
    return out


def test_a_frame_that_arrived_whole_takes_one_syscall() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frames([b"x" * 1200]))
        reader = FrameReader(b)
        calls = []
        real = b.recv_into

        class Counting:
            def recv_into(self, view: memoryview) -> int:
                calls.append(1)
                return real(view)

        reader.sock = Counting()  # type: ignore[assignment]
        assert read_all(reader, 1) == [b"x" * 1200]
        assert len(calls) == 1 and reader.buffered == 0


@settings(max_examples=200, deadline=None)
@given(bodies=st.lists(st.binary(max_size=300), min_size=1, max_size=8),
       cuts=st.lists(st.integers(1, 97), max_size=40),
       capacity=st.sampled_from([8, 16, 64, 4096]))
def test_any_cut_of_the_stream_reads_back_the_frames_sent(
        bodies: list[bytes], cuts: list[int], capacity: int) -> None:
    """Bodies longer than the buffer are read straight into their own buffer."""
    src = Chunks(frames(bodies), cuts)
    reader = FrameReader(src, capacity)  # type: ignore[arg-type]
    assert read_all(reader, len(bodies)) == bodies
    assert reader.buffered == 0


def test_idle_before_a_frame_is_not_an_error_but_inside_one_it_is() -> None:
    reader = FrameReader(Chunks(b"", [], idle_at_end=True))  # type: ignore[arg-type]
    assert reader.header(HEAD.size, idle_ok=True) is None
    reader = FrameReader(Chunks(b"\x05\x00", [2], idle_at_end=True))  # type: ignore[arg-type]
    with pytest.raises(TimeoutError):
        reader.header(HEAD.size, idle_ok=True)
    reader = FrameReader(Chunks(frames([b"abcde"])[:6], [6], idle_at_end=True))  # type: ignore[arg-type]
    view = reader.header(HEAD.size, idle_ok=True)
    assert view is not None and HEAD.unpack(view) == (5,)
    with pytest.raises(TimeoutError):
        reader.exact(5)


def test_a_closed_stream_is_eof() -> None:
    reader = FrameReader(Chunks(frames([b"ab"])[:3], [3]))  # type: ignore[arg-type]
    with pytest.raises(EOFError):
        reader.header(HEAD.size, idle_ok=True)
