"""The cluster KV store (a library; not yet wired into the connector): ``base`` (the
contract, errors and the URL registry), ``names`` (block identity and keys), ``identity`` (a
worker's identity from its KV layout), ``codec``
(the checked value format), ``compression`` (how a block's bytes are encoded:
``--kv-compression``), ``redis_store`` (Redis and Redis Cluster) and
``local_redis`` (a local redis-server or cluster for ``up`` and tests)."""
