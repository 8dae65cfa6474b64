"""What the socket-served data planes share: the wire format, socket I/O, cutting plans
into frames, the served-transport base and the data-plane handshake.
"""
