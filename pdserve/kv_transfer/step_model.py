"""How long one engine step takes, learned from the engine's own steps.

The connector is pdserve's one hook inside vLLM's step loop: its worker side sees each
step's metadata (how many sequences decode, how many prompt tokens are computed) and
when the forward pass starts and ends. ``StepModel`` fits

    step_s = base_s + per_seq_s * num_decode_seqs + per_token_s * num_prefill_tokens

by least squares over recent steps (each step's weight halves every ``half_life``
steps, so the fit follows the machine's load), with a weak ridge toward a prior so a
role that never prefills (or never decodes) keeps a finite answer and says so
(``num_prefill_steps``, ``num_decode_steps``). The router reads the fit through
``GetLoad`` and turns it into the SLO decisions (prefill speed, decode step time vs
batch and prefill tokens); nothing here blocks or allocates per step beyond a few floats.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

# Features are scaled so the normal equations stay well conditioned.
_SEQ_SCALE = 16.0
_TOKEN_SCALE = 1024.0
# A prior worth about one step: 20 ms a step, 2 ms a sequence, 1 ms per 100 prompt
# tokens (the right order for a small model on a CPU core; data outweighs it at once).
_PRIOR = (0.02, 0.002 * _SEQ_SCALE, 1e-5 * _TOKEN_SCALE)
_RIDGE = 1e-3


@dataclass(frozen=True)
class StepEstimate:
    """The fit at one moment, in the units the wire carries (integers)."""

    base_us: int = 0
    per_seq_us: int = 0
    per_token_ns: int = 0
    num_decode_steps: int = 0  # steps with sequences decoding, seen so far
    num_prefill_steps: int = 0  # steps computing prompt tokens, seen so far

    def to_status(self) -> dict[str, int]:
        return {"step_base_us": self.base_us, "step_per_seq_us": self.per_seq_us,
                "step_per_token_ns": self.per_token_ns,
                "step_decode_samples": self.num_decode_steps,
                "step_prefill_samples": self.num_prefill_steps}


class StepModel:
    def __init__(self, half_life: int = 256) -> None:
        if half_life < 1:
            raise ValueError("half_life must be >= 1")
        self._decay = 0.5 ** (1.0 / half_life)
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self.num_decode_steps = 0
        self.num_prefill_steps = 0

    def add(self, num_decode_seqs: int, num_prefill_tokens: int, seconds: float) -> None:
        """One step's composition and its duration."""
        if seconds <= 0 or num_decode_seqs + num_prefill_tokens <= 0:
            return
        x = (1.0, num_decode_seqs / _SEQ_SCALE, num_prefill_tokens / _TOKEN_SCALE)
        d = self._decay
        for i in range(3):
            self._xy[i] = d * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + x[i] * x[j]
        self.num_decode_steps += num_decode_seqs > 0
        self.num_prefill_steps += num_prefill_tokens > 0

    def coefficients(self) -> tuple[float, float, float]:
        """(base_s, per_seq_s, per_token_s): ridge-regularised least squares, each
        clamped at >= 0 (a step never gets cheaper with more work)."""
        a = [[self._xx[i][j] + (_RIDGE if i == j else 0.0) for j in range(3)] for i in range(3)]
        b = [self._xy[i] + _RIDGE * _PRIOR[i] for i in range(3)]
        theta = _solve3(a, b)
        return (max(theta[0], 0.0), max(theta[1], 0.0) / _SEQ_SCALE,
                max(theta[2], 0.0) / _TOKEN_SCALE)

    def estimate(self) -> StepEstimate:
        base, per_seq, per_token = self.coefficients()
        return StepEstimate(round(base * 1e6), round(per_seq * 1e6), round(per_token * 1e9),
                            self.num_decode_steps, self.num_prefill_steps)


def _solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (3x3, positive definite here)."""
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, 3):
            f = m[r][col] / m[col][col]
            for c in range(col, 4):
                m[r][c] -= f * m[col][c]
    out = [0.0] * 3
    for r in (2, 1, 0):
        out[r] = (m[r][3] - sum(m[r][c] * out[c] for c in range(r + 1, 3))) / m[r][r]
    return out


# A gap longer than this between one step's end and the next one's start means the
# engine was idle (waiting for work), not busy with a step's overhead.
_MAX_OVERHEAD_S = 0.25


class StepTimer:
    """Times the engine's steps for a ``StepModel``: ``begin`` when a step's metadata is
    bound (its forward pass starts), ``end`` when the forward is done, both on the
    engine Worker's main thread. A step's time is its forward pass plus the work between
    two back-to-back forwards (sampling, scheduling, the hand-over between processes),
    learned as a moving average. ``estimate`` may be read from any thread."""

    def __init__(self, model: StepModel | None = None) -> None:
        self._model = model or StepModel()
        self._lock = threading.Lock()
        self._overhead_s = 0.0
        self._begun: tuple[float, int, int] | None = None
        self._last_end: float | None = None

    def begin(self, num_decode_seqs: int, num_prefill_tokens: int,
              now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if self._last_end is not None and 0 <= now - self._last_end < _MAX_OVERHEAD_S:
            self._overhead_s += 0.1 * (now - self._last_end - self._overhead_s)
        self._begun = (now, num_decode_seqs, num_prefill_tokens)

    def end(self, now: float | None = None) -> None:
        if self._begun is None:
            return
        now = time.monotonic() if now is None else now
        started, seqs, tokens = self._begun
        self._begun, self._last_end = None, now
        with self._lock:
            self._model.add(seqs, tokens, now - started + self._overhead_s)

    def estimate(self) -> StepEstimate:
        with self._lock:
            return self._model.estimate()
