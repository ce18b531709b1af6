"""Processes: ``pdserve up`` (a router and workers on one machine under a
``Supervisor``, its CPU layout, readiness and scrape targets) and the mains of a worker
process (``serve_worker.py``) and of a simulated worker (``sim_worker.py``).

Every process is started and stopped through ``pdserve.core.process``.
"""
