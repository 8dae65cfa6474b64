"""Pairing with other ranks: which ranks feed which, whether a pair is compatible, the
decode ranks a prefill rank accepted and the prefill groups a decode rank found.
"""
