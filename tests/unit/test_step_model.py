"""The engine step-time fit the connector keeps (``kv_transfer/step_model.py``)."""

from __future__ import annotations

import random

import pytest

from pdserve.kv_transfer.step_model import StepModel, StepTimer


def test_the_fit_recovers_a_linear_step_time_from_noisy_steps() -> None:
    rng = random.Random(0)
    model = StepModel()
    for _ in range(400):
        n, p = rng.randint(0, 32), rng.choice([0, 0, 0, 64, 256, 900])
        model.add(n, p, (0.030 + 0.004 * n + 0.0008 * p) * rng.uniform(0.95, 1.05))
    base, per_seq, per_token = model.coefficients()
    assert base == pytest.approx(0.030, rel=0.15)
    assert per_seq == pytest.approx(0.004, rel=0.1)
    assert per_token == pytest.approx(0.0008, rel=0.1)
    est = model.estimate()
    assert (est.base_us, est.num_decode_steps > 0, est.num_prefill_steps > 0) == (
        round(base * 1e6), True, True)


def test_old_steps_fade_so_the_fit_follows_the_machine() -> None:
    model = StepModel(half_life=32)
    for _ in range(300):
        model.add(4, 0, 0.050)
    for _ in range(300):  # the machine got twice as slow (another tenant, say)
        model.add(4, 0, 0.100)
    base, per_seq, _ = model.coefficients()
    assert base + 4 * per_seq == pytest.approx(0.100, rel=0.02)


def test_a_decode_only_engine_says_it_never_saw_a_prefill() -> None:
    model = StepModel()
    for n in range(1, 50):
        model.add(n % 8 + 1, 0, 0.02 + 0.001 * (n % 8 + 1))
    est = model.estimate()
    assert est.num_prefill_steps == 0 and est.num_decode_steps == 49
    # No prefill step says otherwise: the prior's 1 ms per 100 prompt tokens, finite (the
    # consumer knows from num_prefill_steps that it is unmeasured).
    assert est.per_token_ns == 10_000


def test_empty_or_nonsense_steps_are_ignored() -> None:
    model = StepModel()
    model.add(0, 0, 0.5)
    model.add(3, 0, 0.0)
    assert (model.num_decode_steps, model.num_prefill_steps) == (0, 0)


def test_the_timer_adds_the_work_between_back_to_back_forwards() -> None:
    timer = StepTimer()
    t = 100.0
    for _ in range(200):  # 40 ms forwards, 10 ms apart: 50 ms steps
        timer.begin(8, 0, now=t)
        timer.end(now=t + 0.040)
        t += 0.050
    timer.begin(8, 0, now=t + 30)  # after an idle half minute: no overhead learned
    timer.end(now=t + 30.040)
    est = timer.estimate()
    assert (est.base_us + 8 * est.per_seq_us) / 1e6 == pytest.approx(0.050, rel=0.05)
    timer.end()  # an end without a begin is ignored
