"""The vLLM rig: tiny models, servers, a proxy and the demo that compares connectors."""
