"""The router: an OpenAI-compatible HTTP edge (``http/``) over a dispatcher that
places each request's phases on the workers (``dispatch/``), its planner loop and its
metrics; ``server.py`` builds it from its configs and serves it.

Inside, the same rule as between packages: ``server`` > ``planner_loop`` > ``http`` >
``dispatch`` > ``metrics``. The contracts between them are ``http/base.py`` and
``dispatch/base.py``.
"""
