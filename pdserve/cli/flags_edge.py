"""The flags of the router's HTTP edge (``router/http/edge/config.py``: API keys and
tenants, the admin plane, router processes, admission limits), one part of
``flags.FLAGS`` (``*EDGE_FLAGS``), declared as every flag is (``flag_types.py``)."""

from __future__ import annotations

from pdserve.cli.flag_types import (
    Flag,
    parse_api_key_entries,
    parse_api_keys,
    parse_bool,
    parse_cidrs,
    parse_float,
    parse_int,
    parse_port,
)

EDGE_FLAGS = (
    Flag("api-key", "require `Authorization: Bearer <key>` on /v1/* and /metrics of the main "
         "port (where /metrics then shows the caller's tenant only, and /workers and "
         "/prefix_index are the admin plane's only); repeatable; the environment variable "
         "may hold several, comma-separated; each may name its tenant and limits as a line "
         "of --api-key-file does", None, parse_api_key_entries, repeat=True, metavar="KEY",
         secret=True),
    Flag("api-key-file", "API keys, one per line (blank lines and # comments skipped), "
         "added to --api-key; a line may go on with its tenant and the tenant's limits: "
         "`KEY tenant=NAME max_concurrent=N tokens_per_s=R burst=TOKENS` (keys of one "
         "tenant share its limits; beyond one: 429 with Retry-After; a key without "
         "tenant= is a tenant of its own, key-<n> in pdserve:tenant_* metrics)",
         metavar="PATH"),
    Flag("tenant-isolation", "key: each tenant (a named one, or an API key alone) shares "
         "no cached KV with another (engines' prefix caches, KV tiers, the pool, the "
         "router's prefix index): every request is salted with a keyed hash of its tenant "
         "(never the key), combined with its own cache_salt if it sends one; off: only the "
         "requests' own cache_salt", "off", choices=("off", "key")),
    Flag("tenant-limits-share", "the part of each tenant's limits this router enforces: "
         "give each of R replicas 1/R (max_concurrent rounded up); the processes of "
         "--processes N share their state and enforce the whole limits exactly",
         1.0, parse_float(0, strict=True)),
    Flag("tenant-ledger", "set by --processes for its processes: the file (in /dev/shm) "
         "of the tenants' limit state they share", metavar="PATH"),
    Flag("weight-board", "set by --processes for its processes: the file (in /dev/shm) "
         "of the weights state they share (the gate a refit or /pause closes in all of "
         "them, the version they admit under)", metavar="PATH"),
    Flag("admin-port", "the admin plane's listener (0: none): the views (/metrics with "
         "every series, /workers, /prefix_index), the admin actions (pause, abort_requests, "
         "weight updates, POST /admin/workers/{id}/role) and /health; with an admin key every "
         "route but /health needs it; without one it binds loopback only, open to the "
         "machine's own users", 0, parse_port),
    Flag("admin-key", "the admin plane's key (`Authorization: Bearer <key>`), never a "
         "client --api-key key (refused if it is one); repeatable; the environment variable "
         "may hold several, comma-separated", None, parse_api_keys, repeat=True,
         metavar="KEY", secret=True),
    Flag("admin-key-file", "admin keys, one per line (blank lines and # comments skipped), "
         "added to --admin-key", metavar="PATH"),
    Flag("admin-host", "the admin listener's bind address (without an admin key: loopback, "
         "whatever this says)", "127.0.0.1"),
    Flag("weight-transfer-allow", "router: the addresses (CIDR, repeatable; the environment "
         "variable may hold several, comma-separated) that the weight-transfer routes' "
         "init_info may send workers to (master_address and every other host field; a host "
         "name is resolved and each of its addresses checked); others get 403 before any "
         "worker is called; none: every address is refused", None, parse_cidrs, repeat=True,
         metavar="CIDR"),
    Flag("processes", "router processes on this one --port (SO_REUSEPORT: the kernel spreads "
         "connections), each a full router following membership and KV events; "
         "--max-concurrent/queued-requests are split between them, process i serves its "
         "admin listener on --admin-port + i, and only process 0 may run the planner",
         1, parse_int(1)),
    Flag("router-processes", "up: the router's --processes (router processes on --port)",
         1, parse_int(1)),
    Flag("reuse-port", "bind --port with SO_REUSEPORT, beside other routers on it (what "
         "--processes sets for each of its processes)", False, parse_bool, switch=True),
    Flag("max-concurrent-requests", "generation requests running at once; more wait in "
         "the queue", 256, parse_int(1)),
    Flag("max-queued-requests", "generation requests waiting for a slot; beyond: 429 "
         "with Retry-After", 1024, parse_int(0)),
    Flag("max-queue-wait-s", "how long a request may wait for a slot before its 429",
         30.0, parse_float(0)),
    Flag("max-body-bytes", "largest request body; larger: 413 before it is parsed",
         4 * 1024 * 1024, parse_int(1)),
)
