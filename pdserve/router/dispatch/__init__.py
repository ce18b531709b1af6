"""The router's dispatcher: where each request's prefill and decode run.
Placement policies over frozen worker snapshots, the per-request remote/local decision
from SLOs, the prefix index and its KV-event feed, the worker pool with health and
breakers, migration, the planner, and the one gRPC adapter to workers. Its contract
(``Dispatcher``, ``TokenChunk``, ``Deadline``, its errors) is ``base.py``.
"""
