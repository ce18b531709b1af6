"""pdserve, disaggregated prefill/decode LLM serving on vLLM: one package in one tree,
every module where its import path says (``pdserve.router`` is ``pdserve/router/``; the
former mapping of top-level folders into the namespace is gone, so every tool that
follows imports finds the code).

The packages are layers, each importing only
those below it (``[tool.importlinter]`` in pyproject.toml, checked by ``make test``):
``cli`` > ``bench`` > ``launch`` > ``router`` > ``roles`` > ``worker`` > ``kv_transfer`` |
``membership`` | ``proto`` > ``core``. docs/code-map.md is generated from these docstrings
(``.venv/bin/python scripts/code_map.py --write``).
"""
