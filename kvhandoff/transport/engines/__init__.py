"""Adapters for external transfer engines (Mooncake, NIXL) and what they share."""
