"""The load generator: one workload against one OpenAI-compatible endpoint (``run.py``,
``runner.py``, ``client.py``), its numbers as ``vllm bench serve`` defines them
(``metrics.py``), and ``sweep.py`` over rates."""
