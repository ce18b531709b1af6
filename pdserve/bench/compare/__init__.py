"""``pdserve bench compare`` and ``gaps``: systems started side by side on the same cores
(``systems.py``, ``launch.py``), the same workload against each, one report."""
