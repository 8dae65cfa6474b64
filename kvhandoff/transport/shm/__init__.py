"""The same-host shm transport: the sender copies into the receiver's shared memory."""
