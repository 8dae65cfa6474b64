"""The control plane of one rank: the ZeroMQ channel, its message authentication, and the
batching of control messages and writes within one engine step.
"""
