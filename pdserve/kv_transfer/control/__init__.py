"""The KV control channel every transport shares: length-prefixed JSON messages,
cluster authentication and TLS on each connection, the serving listener and the client pool."""
