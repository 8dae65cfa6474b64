"""Cross-memory attach through ctypes: ``process_vm_readv``, Yama's ``prctl``, and why
the kernel refuses.

``process_vm_readv(pid, local, remote)`` copies bytes from another process's memory
(``remote`` iovecs, addresses in *that* process) into this one's (``local`` iovecs)
in one syscall, with no intermediate buffer: the single copy. The kernel allows it
when this process may ptrace-attach to the other one (``PTRACE_MODE_ATTACH_REALCREDS``):

* the same user, and the other process is dumpable (not setuid, no
  ``PR_SET_DUMPABLE 0``), or this process holds ``CAP_SYS_PTRACE`` over its user
  namespace;
* with Yama, also ``kernel.yama.ptrace_scope``: 0 (classic) as above; 1 (restricted)
  only a descendant, or a process the target named with ``prctl(PR_SET_PTRACER)``
  — :func:`allow_readers` does that on the side being read; 2 (admin) only with
  ``CAP_SYS_PTRACE``; 3 never;
* a seccomp filter may forbid the syscall altogether (container runtimes do, unless the
  container has ``CAP_SYS_PTRACE``).

:func:`process_vm_readv` releases the GIL (ctypes does for ``CDLL`` functions), so copier
threads run in parallel; :func:`process_vm_readv_held` keeps it (``PyDLL``): for a copy
shorter than a GIL hand-over inside a busy engine (getting the GIL back after a
syscall waits up to the switch interval while the engine's thread runs), holding it
is the faster way, and the engine's thread waits for the copy alone. Each call takes
at most :data:`IOV_MAX` iovecs per side and may copy less than asked (a partial copy);
:mod:`kvhandoff.transport.cma.iov` handles both.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
from collections.abc import Callable
from functools import cache

import numpy as np
import numpy.typing as npt

from kvhandoff.transport.base import Availability

log = logging.getLogger("kvhandoff.transport")

IOV_MAX = 1024
"""The most iovecs ``process_vm_readv`` takes per side and call (Linux ``UIO_MAXIOV``)."""

IOV = npt.NDArray[np.uint64]
"""An iovec array: shape ``(n, 2)``, C-contiguous uint64 ``(address, length)`` rows,
exactly the layout of ``struct iovec`` on 64-bit Linux."""

ReadV = Callable[[int, IOV, IOV], int]
"""``readv(pid, local, remote) -> bytes copied``: :func:`process_vm_readv`, or a test's
stand-in. Raises ``OSError`` (with ``errno``) where the syscall returns -1."""

PR_SET_PTRACER = 0x59616D61
PR_SET_PTRACER_ANY = ctypes.c_ulong(-1).value
CAP_SYS_PTRACE = 19
_YAMA = "/proc/sys/kernel/yama/ptrace_scope"


@cache
def _libc(held: bool = False) -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return (ctypes.PyDLL if held else ctypes.CDLL)(None, use_errno=True)
    except OSError:
        return None


@cache
def _readv_fn(held: bool = False) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc = _libc(held)
    fn = getattr(libc, "process_vm_readv", None) if libc is not None else None
    if fn is None:
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                   ctypes.c_ulong, ctypes.c_ulong]
    return fn


def process_vm_readv(pid: int, local: IOV, remote: IOV, *, held: bool = False) -> int:
    """Copy from ``remote`` (iovecs in process ``pid``) into ``local`` (iovecs here);
    returns the bytes copied (possibly fewer than asked: a partial copy). ``OSError``
    with the kernel's errno when it copied nothing and refused. At most
    :data:`IOV_MAX` rows per array (``EINVAL`` beyond). ``held``: keep the GIL
    through the call (see the module's docstring)."""
    fn = _readv_fn(held)
    if fn is None:
        raise OSError(errno.ENOSYS, "process_vm_readv is not available in this C library")
    n = int(fn(pid, local.ctypes.data, len(local), remote.ctypes.data, len(remote), 0))
    if n < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return n


def process_vm_readv_held(pid: int, local: IOV, remote: IOV) -> int:
    """:func:`process_vm_readv` keeping the GIL through the call."""
    return process_vm_readv(pid, local, remote, held=True)


def iovecs(rows: list[tuple[int, int]]) -> IOV:
    """An iovec array of ``(address, length)`` rows (for small, hand-made arrays)."""
    return np.array(rows, dtype=np.uint64).reshape(len(rows), 2)


def ptrace_scope() -> int | None:
    """``kernel.yama.ptrace_scope`` (0..3), or None where Yama is not in the kernel."""
    try:
        with open(_YAMA) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def has_cap_sys_ptrace() -> bool:
    """Whether this process's effective capabilities include ``CAP_SYS_PTRACE``."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


_allow_lock = threading.Lock()
_readers_allowed = False


def allow_readers() -> None:
    """On the side whose memory is read: where Yama restricts ptrace to descendants
    (``ptrace_scope`` 1), name any process as an allowed reader
    (``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``; Yama keeps one name per process, and
    a sender may serve several receivers). Only processes the kernel lets attach under
    scope 0 then may (the same user, or ``CAP_SYS_PTRACE``). Once per process; a failure
    is logged, and the receiver's probe then names the cause."""
    global _readers_allowed
    with _allow_lock:
        if _readers_allowed or ptrace_scope() != 1:
            return
        _readers_allowed = True
        libc = _libc()
        rc = libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(PR_SET_PTRACER_ANY), 0, 0, 0) \
            if libc is not None else -1
        if rc != 0:
            log.warning("cma: prctl(PR_SET_PTRACER, ANY) failed (%s); receivers on this "
                        "host may not be able to read this process", os.strerror(
                            ctypes.get_errno()))
        else:
            log.info("cma: kernel.yama.ptrace_scope is 1: this process let same-user "
                     "processes read its memory (prctl PR_SET_PTRACER_ANY), as the cma "
                     "transport's receivers pull from it")


def probe(readv: ReadV = process_vm_readv) -> Availability:
    """Whether this process can use cross-memory attach at all: the syscall exists, no
    seccomp filter forbids it (a copy from itself, which needs no ptrace rights), and
    Yama does not forbid it for every process. Never raises, no side effects."""
    try:
        if _readv_fn() is None and readv is process_vm_readv:
            return Availability(False, "needs Linux process_vm_readv (glibc >= 2.15)")
        scope = ptrace_scope()
        if scope == 3:
            return Availability(False, "kernel.yama.ptrace_scope is 3: no process may read "
                                       "another's memory until reboot; use tcp or shm")
        if scope == 2 and not has_cap_sys_ptrace():
            return Availability(False, "kernel.yama.ptrace_scope is 2: reading another "
                                       "process needs CAP_SYS_PTRACE, which this process "
                                       "lacks; grant it, lower the scope to 1, or use tcp")
        src = np.frombuffer(os.urandom(16), np.uint8)
        dst = np.zeros(16, np.uint8)
        n = readv(os.getpid(), iovecs([(dst.ctypes.data, 16)]),
                  iovecs([(src.ctypes.data, 16)]))
        if n != 16 or not np.array_equal(src, dst):
            return Availability(False, f"process_vm_readv copied {n} of 16 bytes from this "
                                       f"process itself")
    except OSError as e:
        return Availability(False, f"process_vm_readv fails even within this process: "
                                   f"{explain(e)}")
    except Exception as e:  # a probe never raises
        return Availability(False, f"cross-memory attach probe failed: {e!r}")
    yama = "" if scope is None else f"; kernel.yama.ptrace_scope {scope}"
    return Availability(True, f"built in (same host only: process_vm_readv, single copy{yama})")


def explain(err: OSError, *, pid: int = 0, peer_uid: int | None = None) -> str:
    """Why ``process_vm_readv`` by this process (the receiver) from process ``pid`` (the
    sender, user ``peer_uid``) failed, and the fix, in a sentence a user can act on on
    either side."""
    code = err.errno or 0
    name = errno.errorcode.get(code, str(code))
    me = f"the receiver (pid {os.getpid()}, uid {os.geteuid()})"
    who = f"the sender (pid {pid}" + (f", uid {peer_uid})" if peer_uid is not None else ")")
    if code == errno.EPERM:
        scope = ptrace_scope()
        causes = []
        if peer_uid is not None and peer_uid != os.geteuid():
            causes.append("they run as different users and the receiver lacks "
                          "CAP_SYS_PTRACE: run both as the same user, or grant the receiver "
                          "CAP_SYS_PTRACE")
        if scope == 2:
            causes.append("kernel.yama.ptrace_scope is 2 (only CAP_SYS_PTRACE holders may "
                          "read other processes): grant CAP_SYS_PTRACE or set the scope to 1")
        elif scope == 1:
            causes.append("kernel.yama.ptrace_scope is 1 and the sender did not allow "
                          "readers (an older kvhandoff, or its prctl failed: see its log)")
        causes.append("the sender is non-dumpable (setuid, or PR_SET_DUMPABLE 0), or a "
                      "container or seccomp policy forbids cross-process reads (grant "
                      "CAP_SYS_PTRACE, e.g. docker --cap-add SYS_PTRACE)")
        return (f"the kernel does not let {me} read the memory of {who} ({name}): "
                + "; or ".join(causes) + "; or use the tcp transport")
    if code == errno.ESRCH:
        return (f"{who} does not exist for {me} ({name}): it exited, or lives in another "
                f"PID namespace (cma needs both in one); use tcp")
    if code == errno.ENOSYS:
        return (f"process_vm_readv is not available ({name}): the kernel lacks it or a "
                f"seccomp filter blocks it (containers: grant CAP_SYS_PTRACE); use tcp")
    if code == errno.EFAULT:
        return (f"an address is not mapped ({name}): memory {who} registered was freed "
                f"or never mapped, or a destination of {me} was")
    return f"process_vm_readv by {me} from {who} failed: {name}: {err.strerror}"
