"""The router's workers: one gRPC client and session per worker, its state as placement
reads it, its circuit breaker, and the pool of them all with its metrics."""
