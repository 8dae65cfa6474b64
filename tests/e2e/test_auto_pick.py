"""``transport="auto"`` between real processes: two on one host pick cma; a peer in
another network namespace (a veth link, as in test_two_hosts) picks tcp. Either way the
receiver's buffer ends byte-exact."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest

from kvhandoff.lab.testing import netns
from kvhandoff.transport import available_transports

NBYTES, SEED = 48 << 20, 5
CMA = available_transports()["cma"]
NETNS_OK, NETNS_WHY = netns.available()


def _start(prefix: list[str], role: str, host: str) -> netns.SideProcess:
    cmd = [*prefix, sys.executable, "-m", "kvhandoff.lab.testing.pick", role, "auto", host,
           str(NBYTES), str(SEED)]
    return netns.SideProcess(subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))


def _say(p: netns.SideProcess, line: str) -> None:
    assert p.proc.stdin is not None
    p.proc.stdin.write(f"{line}\n".encode())
    p.proc.stdin.flush()


def _run(receiver: tuple[list[str], str], sender: tuple[list[str], str]) -> tuple[str, str]:
    """A receiving and a sending process (each: command prefix, listen address);
    returns (VIA, DONE) once the receiver was checked to hold what the sender wrote."""
    r = _start(receiver[0], "receive", receiver[1])
    s = _start(sender[0], "send", sender[1])
    try:
        ep = r.expect("ENDPOINT ", 60)
        assert ep is not None, r.lines
        _say(s, f"ENDPOINT {ep}")
        via, done, want = (s.expect(p, 60) for p in ("VIA ", "DONE ", "WANT "))
        assert via is not None and done is not None and want is not None, s.lines
        _say(r, "sha")
        assert r.expect("SHA ", 60) == want, "the receiver's bytes differ from the oracle"
        return via, done
    finally:
        for p in (s, r):
            if p.proc.poll() is None:
                with contextlib.suppress(OSError):
                    _say(p, "exit")
            try:
                p.proc.wait(30)
            except subprocess.TimeoutExpired:
                p.proc.kill()
                p.proc.wait(10)


@pytest.mark.skipif(not CMA.ok, reason=f"cma: {CMA.reason}")
def test_two_processes_on_one_host_pick_cma() -> None:
    via, done = _run(([], "127.0.0.1"), ([], "127.0.0.1"))
    assert (via, done.split()[0]) == ("cma", "done"), done


@pytest.mark.skipif(not NETNS_OK, reason=NETNS_WHY)
def test_a_peer_in_another_network_namespace_picks_tcp() -> None:
    with netns.TwoHosts() as hosts:
        via, done = _run((["ip", "netns", "exec", hosts.decode_ns], hosts.decode_ip),
                         (["ip", "netns", "exec", hosts.prefill_ns], hosts.prefill_ip))
    assert (via, done.split()[0]) == ("tcp", "done"), done
