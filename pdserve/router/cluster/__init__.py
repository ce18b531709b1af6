"""Cluster control: what the router does to its workers as a whole, beside serving
requests. Role switches (``roles.py``), the two-phase weight update and the trainer's
engine calls fanned out to every worker (``weight_updates.py``, ``fanout.py``), and the
planner's loop (``planner_loop.py``: the elected router flips roles by demand).

The admin routes (``router/http/admin``) and the planner call in here. Nothing here
knows HTTP: a refusal or a failure is a ``ClusterError`` (``errors.py``) that says whose
fault it is, and ``router/http/errors.py`` maps it to its status code and OpenAI error
body. An import contract keeps HTTP out (``pyproject.toml``: the router's layers).
"""
