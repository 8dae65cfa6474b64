"""vLLM's ``vllm.general_plugins`` entry point: registers ``KvhandoffConnector`` by name,
so ``{"kv_connector": "KvhandoffConnector"}`` works without ``kv_connector_module_path``.

vLLM may load plugins several times in one process; registering is done once.
"""

from __future__ import annotations

NAME = "KvhandoffConnector"


def register() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(NAME, "kvhandoff.integrations.vllm.connector",
                                              NAME)
