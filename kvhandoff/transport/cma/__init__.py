"""The single-copy same-host transport: the receiver pulls by cross-memory attach.

``kernel`` binds the syscalls (``process_vm_readv``, ``prctl``) and says why the kernel
refuses; ``iov`` turns paired record tables into iovec batches and pulls them; ``frames``
is the wire (the HELLO body, a WRITE's paired records); ``server`` is the receiving
side, ``peer`` the sending side and ``transport`` the :class:`CmaTransport` itself.
"""
