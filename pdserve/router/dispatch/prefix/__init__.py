"""The router's prefix index: which worker holds (or is computing) which KV blocks, fed
by the workers' KV events, and what a request's prompt would reuse on each."""
