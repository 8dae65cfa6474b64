"""Where a transport runs, as a peer can compare it: this machine's boot, and this
process's network namespace.

Two processes share a host, for the same-host transports, when both values match: the
boot id names one boot of one kernel (two machines, or one machine rebooted, differ),
and the network namespace decides who can reach an abstract Unix socket (the rendezvous
of shm and cma). A process in another namespace on the same machine is, for them,
another host: it reaches this one over an IP address only.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


def boot_id() -> str:
    """This machine boot (``/proc/sys/kernel/random/boot_id``; the host name without it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def netns() -> str:
    """This process's network namespace (``net:[inode]``; "" where /proc cannot say)."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return ""


@dataclass(frozen=True, slots=True)
class HostIdentity:
    """A boot and a network namespace: equal identities can meet on abstract sockets
    and attach to each other's memory."""

    boot: str
    net: str

    @staticmethod
    def here() -> HostIdentity:
        return HostIdentity(boot_id(), netns())

    def as_list(self) -> list[str]:
        """For an endpoint's JSON."""
        return [self.boot, self.net]

    @staticmethod
    def parse(value: object) -> HostIdentity | None:
        """From :meth:`as_list`'s form; None if ``value`` is not one."""
        if (isinstance(value, list) and len(value) == 2
                and all(isinstance(v, str) for v in value)):
            return HostIdentity(value[0], value[1])
        return None

    def same_as(self, other: HostIdentity | None) -> bool:
        """Whether ``other`` is this host and network namespace (an unknown namespace,
        "", never matches)."""
        return other is not None and self.boot == other.boot and bool(self.net) \
            and self.net == other.net

    def differs(self, other: HostIdentity | None) -> str:
        """Why ``other`` is not this host, for a message ("" when it is)."""
        if other is None:
            return "the peer did not say which host it is on"
        if self.boot != other.boot:
            return f"another machine (boot id {other.boot[:13]}…, ours {self.boot[:13]}…)"
        if not self.same_as(other):
            return (f"this machine but another network namespace ({other.net or '?'}, ours "
                    f"{self.net or '?'})")
        return ""
