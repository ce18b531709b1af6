"""Sticky sessions (SkyRL's ``X-Session-ID``): the turns of one session go to the decode
worker that served its last turn, which computes the prompt itself from the KV its prefix
cache holds (the dispatcher's ``affinity``: the ``local`` route), while that worker is
healthy and serves the cluster's weights; else placement decides, and the session follows
the worker chosen. This router process's own memory, bounded (the least recently used
session is forgotten first)."""

from __future__ import annotations

from collections import OrderedDict

SESSION_HEADER = "x-session-id"
MAX_SESSIONS = 100_000
MAX_SESSION_ID_CHARS = 256


class SessionAffinity:
    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        if max_sessions < 1:
            raise ValueError("max_sessions must be >= 1")
        self._max = max_sessions
        self._workers: OrderedDict[str, str] = OrderedDict()

    def worker_of(self, session_id: str | None) -> str | None:
        """The decode worker id of ``session_id``'s last turn (None: none known)."""
        if not session_id:
            return None
        worker_id = self._workers.get(session_id)
        if worker_id is not None:
            self._workers.move_to_end(session_id)
        return worker_id

    def remember(self, session_id: str | None, worker_id: str | None) -> None:
        """``session_id``'s last turn ran on ``worker_id``."""
        if not session_id or not worker_id or len(session_id) > MAX_SESSION_ID_CHARS:
            return
        self._workers[session_id] = worker_id
        self._workers.move_to_end(session_id)
        while len(self._workers) > self._max:
            self._workers.popitem(last=False)
