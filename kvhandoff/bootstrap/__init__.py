"""Rendezvous: the bootstrap server where prefill ranks register and decode ranks find
them, its client, its request signing and its metrics.
"""
