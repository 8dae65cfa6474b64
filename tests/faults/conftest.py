"""Fixtures for session fault tests (:mod:`kvhandoff.lab.testing.fixtures`): a bootstrap server
that must end empty, fresh instance names, the in-process rig, and a check that no
``kvh-*`` thread outlives a test."""

from kvhandoff.lab.testing.fixtures import bootstrap, instance, no_leaked_threads, rig

__all__ = ["bootstrap", "instance", "no_leaked_threads", "rig"]
