"""Integrations of kvhandoff with serving engines (vLLM)."""
