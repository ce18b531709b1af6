"""The admin plane (``--admin-port``): its own listener, its own credential
(``--admin-key``, ``--admin-key-file``; never a client key), checked before a byte of the
body is read (``auth.py``), bodies held to a size and to pydantic models (``bodies.py``),
and the weight-transfer routes that make workers connect somewhere off unless the
operator names a backend and the addresses they may reach (``transfer.py``)."""
