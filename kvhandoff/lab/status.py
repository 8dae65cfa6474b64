"""``kvhandoff status BOOTSTRAP_URL``: a live view of a deployment in the terminal.

Built on what the deployment already serves over HTTP: the bootstrap server's instances
(``GET /v1/instances``, then each instance's lookup: its ranks and control endpoints) and
the agents' Prometheus metrics — a prefill rank that serves them puts the URL in its
registration (``metadata["metrics"]``); decode agents register nowhere, so name them with
``--agent URL``. For each agent: live requests, requests by final status, failures by
reason and how many are new since the last refresh. ``--json`` prints one snapshot for
scripts. Every request has a timeout; an agent that does not answer shows as such.

:func:`collect` gathers a :class:`Snapshot` (I/O), :func:`render` turns one into text
(pure), :func:`main` loops.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from kvhandoff.bootstrap.client import Health, InstanceInfo, InstanceList

TIMEOUT_S = 5.0
MAX_BODY = 4 << 20  # what one answer may be (the bootstrap caps a lookup at 2 MiB)
Get = Callable[[str], bytes]


def http_get(url: str) -> bytes:
    """``GET url`` (a bounded read); raises OSError for any failure, HTTP errors with a
    body (a 503 lookup) included — see :func:`_lookup`."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as r:
            return bytes(r.read(MAX_BODY))
    except urllib.error.HTTPError as e:
        if e.code == 503:
            return bytes(e.read(MAX_BODY))
        raise


@dataclass
class Rank:
    slot: str  # "dp0 tp1 pp0"
    endpoint: str
    metrics: str  # its metrics URL, "" when it publishes none


@dataclass
class Instance:
    name: str
    ready: bool
    registered: int
    expected: int
    transport: str
    ranks: list[Rank] = field(default_factory=list)


@dataclass
class Agent:
    url: str
    ok: bool
    error: str = ""
    live: dict[str, float] = field(default_factory=dict)  # role -> in flight
    peers: dict[str, float] = field(default_factory=dict)  # role -> peers handshaken
    requests: dict[str, float] = field(default_factory=dict)  # "role status" -> count
    failures: dict[str, float] = field(default_factory=dict)  # "role reason" -> count
    new_failures: dict[str, float] = field(default_factory=dict)  # since the last snapshot


@dataclass
class Snapshot:
    bootstrap: str
    at: float
    health: dict[str, Any] | None
    error: str = ""
    instances: list[Instance] = field(default_factory=list)
    agents: list[Agent] = field(default_factory=list)


def _lookup(base: str, name: str, get: Get) -> list[Rank]:
    raw = get(f"{base}/v1/instances/{urllib.parse.quote(name, safe='')}")
    obj = msgspec.json.decode(raw)
    if not isinstance(obj, dict) or "ranks" not in obj:  # a NotReady answer (503)
        return []
    info = msgspec.convert(obj, InstanceInfo)
    return [Rank(slot=f"dp{r.dp_rank} tp{r.tp_rank} pp{r.pp_rank}", endpoint=r.control_endpoint,
                 metrics=r.metadata.get("metrics", "")) for r in info.ranks]


def scrape(url: str, get: Get, before: Agent | None = None) -> Agent:
    """One agent's metrics endpoint, summarised (``before``: the last summary, for the
    failures that are new)."""
    try:
        text = get(url).decode()
    except (OSError, UnicodeDecodeError) as e:
        return Agent(url=url, ok=False, error=f"{type(e).__name__}: {e}")
    a = Agent(url=url, ok=True)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            lab = s.labels
            if s.name == "kvhandoff_live_requests":
                a.live[lab.get("role", "")] = s.value
            elif s.name == "kvhandoff_peers":
                a.peers[lab.get("role", "")] = s.value
            elif s.name == "kvhandoff_requests_total":
                key = f"{lab.get('role', '')} {lab.get('status', '')}"
                a.requests[key] = a.requests.get(key, 0.0) + s.value
            elif s.name == "kvhandoff_failures_total":
                key = f"{lab.get('role', '')} {lab.get('reason', '')}"
                a.failures[key] = a.failures.get(key, 0.0) + s.value
    old = before.failures if before is not None else {}
    a.new_failures = {k: v - old.get(k, 0.0) for k, v in a.failures.items()
                      if v > old.get(k, 0.0)}
    return a


def collect(bootstrap: str, agents: Sequence[str] = (), *, get: Get = http_get,
            before: Snapshot | None = None) -> Snapshot:
    """Everything the view shows, now."""
    base = bootstrap.rstrip("/")
    if "://" not in base:
        base = f"http://{base}"
    snap = Snapshot(bootstrap=base, at=time.time(), health=None)
    try:
        snap.health = msgspec.to_builtins(msgspec.json.decode(get(f"{base}/health"),
                                                              type=Health))
        listing = msgspec.json.decode(get(f"{base}/v1/instances"), type=InstanceList)
        for s in listing.instances:
            inst = Instance(name=s.instance, ready=s.ready, registered=s.registered,
                            expected=s.expected, transport=s.transport)
            inst.ranks = _lookup(base, s.instance, get)
            snap.instances.append(inst)
    except (OSError, msgspec.MsgspecError) as e:
        snap.error = f"{type(e).__name__}: {e}"
    urls = list(dict.fromkeys([r.metrics for i in snap.instances for r in i.ranks
                               if r.metrics] + list(agents)))
    last = {a.url: a for a in before.agents} if before is not None else {}
    snap.agents = [scrape(u, get, last.get(u)) for u in urls]
    return snap


def _counts(d: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(d.items()) if v) or "none"


def render(s: Snapshot) -> str:
    """The snapshot as lines of text."""
    when = time.strftime("%H:%M:%S", time.localtime(s.at))
    lines = [f"kvhandoff status — bootstrap {s.bootstrap} at {when}"]
    if s.error:
        lines.append(f"  bootstrap: {s.error}")
    if s.health is not None:
        h = s.health
        lines.append(f"  {h['instances']} instances ({h['ready_instances']} ready), "
                     f"{h['ranks']} ranks registered")
    for i in s.instances:
        state = "ready" if i.ready else f"waiting: {i.registered}/{i.expected} ranks"
        lines.append(f"  instance {i.name} [{i.transport}] {state}")
        for r in i.ranks:
            lines.append(f"    {r.slot}  {r.endpoint}  metrics {r.metrics or '-'}")
    for a in s.agents:
        if not a.ok:
            lines.append(f"  agent {a.url}: not answering ({a.error})")
            continue
        live = ", ".join(f"{role} {n:g}" for role, n in sorted(a.live.items())) or "0"
        peers = ", ".join(f"{role} {n:g}" for role, n in sorted(a.peers.items())) or "0"
        lines.append(f"  agent {a.url}: peers {peers}; live {live}; "
                     f"finished {_counts(a.requests)}")
        lines.append(f"    failures {_counts(a.failures)}"
                     + (f"; new {_counts(a.new_failures)}" if a.new_failures else ""))
    return "\n".join(lines)


def main(bootstrap: str, agents: Sequence[str], *, interval: float, count: int | None,
         as_json: bool, out: Callable[[str], None] = print) -> int:
    """``kvhandoff status``: ``--json`` prints one snapshot; otherwise refresh every
    ``interval`` s, ``count`` times (None: until Ctrl-C). 0 when the bootstrap answered."""
    if as_json:
        one = collect(bootstrap, agents)
        out(json.dumps(asdict(one), indent=1))
        return 0 if not one.error else 1
    snap: Snapshot | None = None
    n = 0
    try:
        while count is None or n < count:
            snap = collect(bootstrap, agents, before=snap)
            out(render(snap))
            n += 1
            if count is None or n < count:
                time.sleep(interval)
    except KeyboardInterrupt:
        pass
    return 0 if snap is not None and not snap.error else 1
