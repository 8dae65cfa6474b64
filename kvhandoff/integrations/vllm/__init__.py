"""kvhandoff inside vLLM: :class:`KvhandoffConnector`, a vLLM KV connector.

``kvhandoff.integrations.vllm`` is the ``kv_connector_module_path``; the connector class
is imported lazily so the pure pieces (:mod:`.layout`, :mod:`.requests`, :mod:`.scheduler`)
load without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["KvhandoffConnector"]


def __getattr__(name: str) -> Any:
    if name == "KvhandoffConnector":
        from kvhandoff.integrations.vllm.connector import KvhandoffConnector

        return KvhandoffConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
