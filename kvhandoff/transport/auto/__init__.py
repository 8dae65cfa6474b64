"""``transport="auto"``: per peer, the fastest transport both sides can use.

``policy`` decides (pure: where the peer is, what both offer → an ordered choice and
why); ``transport`` is :class:`AutoTransport`, which holds the offered sub-transports
and connects each peer through its choice.
"""
