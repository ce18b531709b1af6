"""Layer-wise push: the prefill sends each layer's KV blocks as soon as they are computed;
the decode keeps them in a bounded inbox until its engine asks."""
