"""Fixtures for session fault tests (:mod:`kvhandoff.lab.testing.fixtures`): a bootstrap server
that must end empty, fresh instance names, the in-process rig (and an open, ``insecure``
one, for peers that speak without the secret), and a check that no ``kvh-*`` thread
outlives a test."""

from kvhandoff.lab.testing.fixtures import (
    bootstrap,
    instance,
    no_leaked_threads,
    open_bootstrap,
    open_rig,
    rig,
)

__all__ = ["bootstrap", "instance", "no_leaked_threads", "open_bootstrap", "open_rig", "rig"]
