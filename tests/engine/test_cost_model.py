"""The step cost model's fit, on synthetic step times (no model, no timing)."""
import random

import pytest

from workers.engine.cost_model import STALL_CLIP, CostModel

TRUE = (0.020, 0.0008, 0.000002)     # fixed, per new token, per attended context token (seconds)


def true_time(tokens, attended):
    return TRUE[0] + TRUE[1] * tokens + TRUE[2] * attended


def shapes(n, seed=0):
    rng = random.Random(seed)
    for _ in range(n):
        tokens = rng.choice([1, 4, 16, 64, 128, 256])
        yield tokens, tokens * rng.randint(16, 600)


def test_fit_recovers_the_coefficients_of_clean_steps():
    cost = CostModel()
    for tokens, attended in shapes(300):
        cost.observe(tokens, attended, true_time(tokens, attended))
    assert (cost.fixed, cost.per_token, cost.per_context) == pytest.approx(TRUE, rel=0.02)


def test_stalled_steps_do_not_drag_the_fit():
    """One step in ten stalls for 20x its time (a loaded host): the fit still predicts the typical step
    within a few percent, where a plain mean would predict steps nearly three times slower."""
    cost = CostModel()
    cost.seed(*TRUE)
    rng = random.Random(1)
    for tokens, attended in shapes(400, seed=2):
        t = true_time(tokens, attended)
        cost.observe(tokens, attended, t * 20 if rng.random() < 0.1 else t)
    for tokens, attended in ((1, 300), (64, 64 * 200), (256, 256 * 100)):
        assert cost.predict(tokens, attended) == pytest.approx(true_time(tokens, attended), rel=0.1)


def test_a_real_slowdown_is_followed():
    """The device gets twice as slow for good (clock drop, a co-tenant): the fit follows, clip or not."""
    cost = CostModel()
    cost.seed(*TRUE)
    for tokens, attended in shapes(1500, seed=3):
        cost.observe(tokens, attended, 2 * true_time(tokens, attended))
    assert STALL_CLIP < 2
    assert cost.predict(64, 64 * 200) == pytest.approx(2 * true_time(64, 64 * 200), rel=0.1)


def test_unseeded_model_learns_from_zero():
    cost = CostModel()
    for _ in range(3):
        cost.observe(16, 16 * 100, true_time(16, 16 * 100))
    assert cost.predict(16, 16 * 100) == pytest.approx(true_time(16, 16 * 100), rel=0.05)
