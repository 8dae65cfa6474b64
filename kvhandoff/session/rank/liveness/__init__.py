"""Liveness: which peers are silent (pure books), the watch over them, and the heartbeats."""
