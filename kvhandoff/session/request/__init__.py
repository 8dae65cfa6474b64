"""One request on one rank: the sans-IO cores, the Sender and Receiver shells around them,
the status machine, and the pieces a request's bytes need (chunks, aux rows, checksums).
"""
