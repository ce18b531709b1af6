"""The worker's gRPC API: ``pdserve/v1/worker.proto``, its generated stubs
(``make proto``) and the one conversion layer ``convert.py`` (protobuf to and from
``pdserve.core.types``).

Protobuf stays at the edge: only the worker's servicer and the router's worker client
import it (a ``protected`` contract in pyproject.toml).
"""
