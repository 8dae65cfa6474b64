"""Staging: fragmented plans through request-rate-bound engines, in a few large writes.

Engines pay per request (Mooncake TCP ~36 µs, NIXL ``cma`` ~3 µs), so a plan made of
1 KiB head slices or scattered 4 KiB pages crawls through them. When a plan is
fragmented, the engine adapters (``mooncake``, ``nixl``) route it through this module
instead, and the session layer sees the same contract (one handle, DONE once the
bytes are in place, refused writes write nothing):

    sender                                         receiver
    ------                                         --------
    gather a frame of the plan into one of its     owns an *arena* of slots registered
    registered outbound buffers (numpy)            with the engine at its first
    engine write: buffer → a slot of the peer's    ``endpoint()``, and a small control
    arena (one large request)                      server (TCP) advertised in it
    COMMIT(slot, destination records) ─────────▶   bounds-check the records against its
                                                   registered memory, scatter the slot
                                        ◀───────── (numpy views), REPLY OK / refused
    handle DONE after the last frame's REPLY

* **Authentication.** The control connection opens with the mutual challenge–response
  of :mod:`~kvhandoff.transport.framing.handshake`, keyed with the staging option's token
  (or HMAC(``data_secret``, token) with the deployment secret's data-plane key); the
  token never travels on the socket, the server reads no frame and leases nothing before
  the sender proved the key, and the sender commits nothing to a server that did not
  prove it. Connections from one address are capped
  (``StagingConfig.max_connections_per_host``). The engine writes into the slots are the
  engine's own data plane, not authenticated by kvhandoff: the slots are registered
  memory that only the leased, authenticated sender's COMMITs make the receiver scatter.
* **Slots.** At ``connect`` the sender dials the control server, passes the handshake
  and is *leased* up to ``slots_per_peer`` slots for the life of the connection
  (fewer, or 0, when the arena is short: that peer then goes direct). Only the lease
  holder commits a slot. A sender that closes with no engine write into its slots
  possibly still running (its threads exited, every write it posted completed) says
  BYE before closing; the receiver then returns the slots to the back of the free list
  at once. A connection that ends any other way (EOF, error, a malformed frame, a
  sender killed, or a close that abandoned a write) may still have a late write on its
  way into those slots, which must not land in a frame of the next lease holder: they
  are *quarantined* for ``quarantine`` seconds (default ``max(io_timeout, 30 s)``, see
  :class:`StagingConfig`) and only then return to the free list, lazily, when a later
  HELLO leases (no timer thread). A goodbye that does not arrive only delays reuse.
* **Write safety.** A multi-frame plan's whole destination side is sent first as a
  CHECK (like tcp's); the receiver refuses it, and every COMMIT of that plan, before
  scattering anything. Each COMMIT is bounds-checked again before its scatter. The
  adapters also refuse destinations outside the peer's advertised table at submit.
* **Frames** are :func:`kvhandoff.transport.framing.cut.split` frames (factored chunks of
  at most ``slot_bytes``); their destination records travel in the COMMIT, so gather
  and scatter are one numpy call per chunk, never a Python call per page or row.
* **Bounded.** Every wait (a free slot, an engine write, a reply) is bounded by
  ``io_timeout``; whatever goes wrong fails the handle (``PeerLost`` for the wire or an
  engine write that never completes, ``RemoteOutOfBounds`` for a refusal) and nothing
  is leaked: buffers return to the pool, slots to the receiver.
* **Host memory only**: plans touching device memory, and peers without staging, go
  direct.

The control protocol reuses the tcp transport's frame header and record tables
(:mod:`kvhandoff.transport.framing.wire`), after the handshake: HELLO (empty) → REPLY OK
carrying the leased slots as JSON; WRITE(desc = ``<q job, q slot>`` + records), with
``FLAG_CHECK`` for a whole-plan check (slot -1) → REPLY; BYE (nothing else in the frame,
no reply), then the sender closes.
"""


from kvhandoff.transport.staging.arena import Arena, gather, scatter
from kvhandoff.transport.staging.common import (
    QUARANTINE_FLOOR,
    StagingConfig,
    estimate_segments,
    host_regions,
)
from kvhandoff.transport.staging.rank import Staging
from kvhandoff.transport.staging.receiver import StagingServer
from kvhandoff.transport.staging.sender import StagedHandle, StagingLink, say_bye

__all__ = [
    "QUARANTINE_FLOOR",
    "Arena",
    "StagedHandle",
    "Staging",
    "StagingConfig",
    "StagingLink",
    "StagingServer",
    "estimate_segments",
    "gather",
    "host_regions",
    "say_bye",
    "scatter",
]
