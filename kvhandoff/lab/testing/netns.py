"""Two "hosts" on one machine: network namespaces joined by a veth pair. Test support.

:class:`TwoHosts` creates namespaces ``kvh-p-<tag>`` (prefill, ``10.<a>.<b>.1``) and
``kvh-d-<tag>`` (decode, ``10.<a>.<b>.2``) joined by a veth link, runs commands in
them, can cut the link (``ip link set ... down``) and removes everything on exit.
:func:`available` says whether this machine lets us (root, ``ip netns``), with the
reason when not.

Each side runs as ``python -m kvhandoff.lab.testing.netns`` inside its namespace
(``ip netns exec``): it reads a pickled :class:`SideJob` on stdin, runs the side
(prefill also serves the bootstrap server on its address), prints ``STATE <state>`` the
first time one of its requests reaches a state listed in the job's ``announce``, then
``REPORT <json>`` once every request is terminal, and waits for a line on stdin before
closing its agents and printing ``LEAKS <json>``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvhandoff.lab.testing.handoff import Scenario
from kvhandoff.lab.testing.sides import _Side

BOOTSTRAP_PORT = 18998


def available() -> tuple[bool, str]:
    """Whether network namespaces can be created here, and why not."""
    if sys.platform != "linux":
        return False, "network namespaces need Linux"
    if os.geteuid() != 0:
        return False, "creating network namespaces needs root"
    if shutil.which("ip") is None:
        return False, "the `ip` tool (iproute2) is not installed"
    name = f"kvh-probe-{secrets.token_hex(3)}"
    try:
        subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True, timeout=10)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        err = getattr(e, "stderr", b"") or b""
        return False, f"`ip netns add` is not permitted here: {err.decode().strip() or e}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return True, ""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    subprocess.run(cmd, check=True, capture_output=True, timeout=10)


class TwoHosts:
    """Two namespaces and a veth link between them; a context manager."""

    def __init__(self) -> None:
        tag = secrets.token_hex(3)
        n = int(tag, 16)
        self.prefill_ns, self.decode_ns = f"kvh-p-{tag}", f"kvh-d-{tag}"
        self._veth_p, self._veth_d = f"kvp{tag}", f"kvd{tag}"
        net = f"10.{100 + n % 100}.{n // 100 % 250}"
        self.prefill_ip, self.decode_ip = f"{net}.1", f"{net}.2"

    def __enter__(self) -> TwoHosts:
        try:
            for ns in (self.prefill_ns, self.decode_ns):
                _ip("netns", "add", ns)
                _ip("link", "set", "lo", "up", ns=ns)
            _ip("link", "add", self._veth_p, "type", "veth", "peer", "name", self._veth_d)
            _ip("link", "set", self._veth_p, "netns", self.prefill_ns)
            _ip("link", "set", self._veth_d, "netns", self.decode_ns)
            for ns, dev, addr in ((self.prefill_ns, self._veth_p, self.prefill_ip),
                                  (self.decode_ns, self._veth_d, self.decode_ip)):
                _ip("addr", "add", f"{addr}/24", "dev", dev, ns=ns)
                _ip("link", "set", dev, "up", ns=ns)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def cut(self) -> None:
        """Take the link down on both ends (packets in flight are lost)."""
        _ip("link", "set", self._veth_p, "down", ns=self.prefill_ns)
        _ip("link", "set", self._veth_d, "down", ns=self.decode_ns)

    def restore(self) -> None:
        """Bring the link back up on both ends (the addresses stay across down/up)."""
        _ip("link", "set", self._veth_p, "up", ns=self.prefill_ns)
        _ip("link", "set", self._veth_d, "up", ns=self.decode_ns)

    def popen(self, ns: str) -> subprocess.Popen[bytes]:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m",
                                 "kvhandoff.lab.testing.netns"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)

    def __exit__(self, *exc: object) -> None:
        for ns in (self.prefill_ns, self.decode_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)


@dataclass
class SideJob:
    role: str
    scenario: Scenario
    url: str
    host: str  # this side's address (control socket, transport, bootstrap server)
    announce: tuple[str, ...] = ()


@dataclass
class SideProcess:
    """One side running in a namespace; read its lines with :meth:`expect`."""

    proc: subprocess.Popen[bytes]
    lines: list[str] = field(default_factory=list)

    def start(self, job: SideJob) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(pickle.dumps(job).hex().encode() + b"\n")
        self.proc.stdin.flush()

    def expect(self, prefix: str, timeout: float) -> str | None:
        """The rest of the next line starting with ``prefix`` (None on EOF or timeout)."""
        assert self.proc.stdout is not None
        out: list[str | None] = [None]

        def read() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode().rstrip("\n")
                self.lines.append(line)
                if line.startswith(prefix):
                    out[0] = line[len(prefix):].strip()
                    return

        t = threading.Thread(target=read, daemon=True)
        t.start()
        t.join(timeout)
        return out[0]

    def finish(self, timeout: float = 60) -> dict[str, object] | None:
        """Tell the side to close; its leak report."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(b"close\n")
            self.proc.stdin.flush()
        got = self.expect("LEAKS ", timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        return None if got is None else dict(json.loads(got))


# ---------------------------------------------------------------------------------------
# Inside a namespace


def _main() -> int:
    from kvhandoff.bootstrap.server import BootstrapServer
    from kvhandoff.lab.testing.sides import DecodeSide, PrefillSide, _fds, _kvh_threads

    job: SideJob = pickle.loads(bytes.fromhex(sys.stdin.readline().strip()))
    scn = dataclasses.replace(job.scenario, config={
        **job.scenario.config, "host": job.host, "advertise_host": job.host},
        transport_options={**job.scenario.transport_options, "host": job.host})
    base = _fds()
    with contextlib.ExitStack() as stack:
        if job.role == "prefill":
            stack.enter_context(BootstrapServer(job.host, BOOTSTRAP_PORT))
            side: PrefillSide | DecodeSide = PrefillSide(scn, job.url)
            side.start()
        else:
            side = DecodeSide(scn, job.url)
            side.start()
        stack.callback(side.close)
        if job.announce:
            threading.Thread(target=_announce, args=(side, job.announce), daemon=True).start()
        report = side.join(scn.timeout + 30)
        print("REPORT " + json.dumps(dataclasses.asdict(report), default=str), flush=True)
        sys.stdin.readline()  # "close"
    threads = _kvh_threads()
    for _ in range(100):
        if not threads:
            break
        time.sleep(0.05)
        threads = _kvh_threads()
    print("LEAKS " + json.dumps({"threads": threads, "fds": _fds() - base}), flush=True)
    return 0


def _announce(side: _Side, states: tuple[str, ...]) -> None:
    said: set[str] = set()
    for _ in range(20_000):  # ~100 s at most
        for a in list(side.agents):
            for r in a.live():
                st = r.poll().value
                if st in states and st not in said:
                    said.add(st)
                    print(f"STATE {st}", flush=True)
        if said >= set(states):
            return
        time.sleep(0.005)


@contextlib.contextmanager
def two_hosts() -> Iterator[TwoHosts]:
    with TwoHosts() as h:
        yield h


if __name__ == "__main__":
    sys.exit(_main())
