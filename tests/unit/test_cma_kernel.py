"""Why the kernel refuses cross-memory attach, in words a user can act on; and the
availability probe, which never raises."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

from kvhandoff.transport.cma import kernel
from kvhandoff.transport.cma.kernel import IOV, explain, probe


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))


def test_another_user_is_named_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "ptrace_scope", lambda: None)
    msg = explain(_err(errno.EPERM), pid=4242, peer_uid=os.geteuid() + 1)
    assert "pid 4242" in msg and f"uid {os.geteuid() + 1}" in msg
    assert "same user" in msg and "CAP_SYS_PTRACE" in msg and "tcp" in msg
    assert f"receiver (pid {os.getpid()}" in msg


@pytest.mark.parametrize(("scope", "words"), [
    (2, "ptrace_scope is 2"), (1, "did not allow readers"), (None, "non-dumpable")])
def test_yama_and_containers_are_named(monkeypatch: pytest.MonkeyPatch, scope: int | None,
                                       words: str) -> None:
    monkeypatch.setattr(kernel, "ptrace_scope", lambda: scope)
    msg = explain(_err(errno.EPERM), pid=7, peer_uid=os.geteuid())
    assert words in msg and "EPERM" in msg
    assert "docker --cap-add SYS_PTRACE" in msg


@pytest.mark.parametrize(("code", "words"), [
    (errno.ESRCH, "PID namespace"), (errno.ENOSYS, "seccomp"), (errno.EFAULT, "not mapped"),
    (errno.ENOMEM, "ENOMEM")])
def test_other_errors_say_what_they_mean(code: int, words: str) -> None:
    assert words in explain(_err(code), pid=9)


def test_probe_says_yes_here() -> None:
    ok, reason = probe()
    assert ok, reason
    assert "single copy" in reason


def test_probe_reports_a_blocked_syscall(monkeypatch: pytest.MonkeyPatch) -> None:
    """A seccomp filter (a container) makes even a read of oneself fail: not usable."""
    monkeypatch.setattr(kernel, "ptrace_scope", lambda: None)

    def blocked(pid: int, local: IOV, remote: IOV) -> int:
        raise _err(errno.ENOSYS)

    ok, reason = probe(blocked)
    assert not ok and "seccomp" in reason


def test_probe_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "ptrace_scope", lambda: None)

    def broken(pid: int, local: IOV, remote: IOV) -> int:
        raise RuntimeError("boom")

    ok, reason = probe(broken)
    assert not ok and "boom" in reason


@pytest.mark.parametrize(("scope", "cap", "ok"), [(3, True, False), (2, False, False),
                                                  (2, True, True), (1, False, True)])
def test_probe_follows_yama(monkeypatch: pytest.MonkeyPatch, scope: int, cap: bool,
                            ok: bool) -> None:
    monkeypatch.setattr(kernel, "ptrace_scope", lambda: scope)
    monkeypatch.setattr(kernel, "has_cap_sys_ptrace", lambda: cap)
    got, reason = probe()
    assert got is ok, reason
    if not ok:
        assert f"ptrace_scope is {scope}" in reason


def test_yama_restricted_lets_readers_in_once(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """Under ``ptrace_scope`` 1 the side that is read names any process as its allowed
    reader (``PR_SET_PTRACER_ANY``), once per process, and says so (or why it could not:
    a kernel without Yama refuses the prctl)."""
    calls: list[tuple[int, int]] = []

    class Libc:
        def prctl(self, option: int, arg: object, *rest: int) -> int:
            calls.append((option, getattr(arg, "value", arg)))
            return 0

    monkeypatch.setattr(kernel, "ptrace_scope", lambda: 1)
    monkeypatch.setattr(kernel, "_libc", lambda: Libc())
    monkeypatch.setattr(kernel, "_readers_allowed", False)
    with caplog.at_level("INFO", "kvhandoff.transport"):
        kernel.allow_readers()
        kernel.allow_readers()
    assert calls == [(kernel.PR_SET_PTRACER, kernel.PR_SET_PTRACER_ANY)]
    assert any("PR_SET_PTRACER_ANY" in r.getMessage() for r in caplog.records)


def test_other_scopes_leave_the_process_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernel, "_readers_allowed", False)
    for scope in (None, 0, 2):
        monkeypatch.setattr(kernel, "ptrace_scope", lambda s=scope: s)
        monkeypatch.setattr(kernel, "_libc", lambda: pytest.fail("prctl called"))
        kernel.allow_readers()


@pytest.mark.parametrize("held", [False, True])
def test_both_calls_copy_the_same_bytes(held: bool) -> None:
    """The GIL-keeping call (a ``PyDLL`` function: ctypes keeps the GIL for those) and
    the releasing one copy alike, partial iovecs included."""
    src = np.frombuffer(os.urandom(4096), np.uint8)
    dst = np.zeros(4096, np.uint8)
    local = kernel.iovecs([(dst.ctypes.data, 1000), (dst.ctypes.data + 1000, 3096)])
    remote = kernel.iovecs([(src.ctypes.data, 4096)])
    assert kernel.process_vm_readv(os.getpid(), local, remote, held=held) == 4096
    assert (dst == src).all()
    fn = kernel._readv_fn(held)
    assert fn is not None
    assert bool(fn._flags_ & ctypes._FUNCFLAG_PYTHONAPI) == held  # type: ignore[attr-defined]
