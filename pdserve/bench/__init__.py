"""``pdserve bench``: load-generator benchmarks against OpenAI-compatible endpoints."""
