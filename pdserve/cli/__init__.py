"""The ``pdserve`` command: the only package that reads ``argparse``. Every flag
is declared once (``flags.py``), every component's frozen config is built here
(``configs.py``), and each command hands its configs to the room that runs it.
"""
