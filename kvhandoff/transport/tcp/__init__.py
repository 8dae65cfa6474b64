"""The built-in tcp transport: RDMA-write semantics over plain sockets."""
