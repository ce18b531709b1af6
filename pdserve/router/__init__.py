"""The router: an OpenAI-compatible HTTP edge (``http/``) over cluster control (``cluster/``:
role switches, weight updates, the planner loop) over a dispatcher that places each
request's phases on the workers (``dispatch/``), and its metrics; ``server.py`` builds it
from its configs and serves it.

Inside, the same rule as between packages: ``server`` > ``http`` > ``cluster`` >
``dispatch`` > ``metrics``. The contracts between them are ``http/base.py``,
``cluster/errors.py`` and ``dispatch/base.py``.
"""
