"""The simulated engine (router-scale tests and benchmarks, never instead of vLLM):
``engine.py`` behind the ``Engine`` contract, ``cache.py`` its prefix cache and step clock."""
