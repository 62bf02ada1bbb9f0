"""The step cost model's fit, on synthetic step times (no model, no timing)."""
import random

import pytest

from tidepool.workers.engine.cost_model import DRIFT_WINDOW, STALL_CLIP, CostModel, attended

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


def observe_with_stalls(cost, n, seed):
    """n clean steps of mixed shapes, one in ten (at random) stalled for 20x its time."""
    rng = random.Random(seed)
    for tokens, attended in shapes(n, seed=seed):
        t = true_time(tokens, attended)
        cost.observe(tokens, attended, t * 20 if rng.random() < 0.1 else t)


def test_stalled_steps_do_not_drag_the_fit():
    """One step in ten stalls for 20x its time (a loaded host): the fit still predicts the typical step
    within a few percent, where a plain mean would predict steps nearly three times slower."""
    cost = CostModel()
    cost.seed(*TRUE)
    observe_with_stalls(cost, 400, seed=2)
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



# The shapes calibrate() times: a 64-token prompt chunk, 16 decodes at context 64, one decode at context 16.
CALIBRATION = ((64, attended(0, 64)), (16, 16 * 65), (1, 17))
DECODE = (16, 16 * 400)              # a steady batch of 16 decodes at context ~400


def too_slow():
    """Seeded as calibrate() seeds it, from steps timed beside a process loading a core (as measured: no
    fixed cost, ten times the per-token cost): the steady decode step is predicted ~15x too slow."""
    cost = CostModel()
    for tokens, att in CALIBRATION:
        cost.observe(tokens, att, 10 * TRUE[1] * tokens + 10 * TRUE[2] * att)
    cost.seed(cost.fixed, cost.per_token, cost.per_context)
    return cost


def too_fast():
    cost = CostModel()
    cost.seed(*(c / 10 for c in TRUE))
    return cost


def steps_to_recover(cost, factor=1.0, limit=60):
    """Steady decode steps at `factor` x the true cost until the prediction for that shape is within 20%."""
    for step in range(1, limit + 1):
        cost.observe(*DECODE, factor * true_time(*DECODE))
        if cost.predict(*DECODE) == pytest.approx(factor * true_time(*DECODE), rel=0.2):
            return step
    return None


def test_a_calibration_ten_times_too_slow_is_undone():
    """Steady steps of one shape cannot undo a bad calibration by themselves (the ridge holds the bad split,
    the calibration steps fade slowly); the drift check sees the fit keep mispredicting and rescales it."""
    cost = too_slow()
    assert cost.predict(*DECODE) > 10 * true_time(*DECODE)
    assert steps_to_recover(cost) <= DRIFT_WINDOW + 4
    assert cost.recalibrations == 1
    assert cost.as_dict()["recalibrations"] == 1


def test_a_calibration_ten_times_too_fast_is_undone():
    """Too fast, clipping lets the fit climb only so fast; the drift check looks at the unclipped steps."""
    cost = too_fast()
    assert cost.predict(*DECODE) == pytest.approx(true_time(*DECODE) / 10)
    assert steps_to_recover(cost) <= DRIFT_WINDOW + 4
    assert cost.recalibrations == 1


@pytest.mark.parametrize("factor", [10, 0.1])
def test_a_lasting_change_after_a_long_history_is_followed(factor):
    """Hundreds of steps fitted at one speed, then the device gets 10x slower (a co-tenant) or faster (it
    left) for good: the old statistics would hold the fit back for hundreds of steps; a rescale drops them."""
    cost = CostModel()
    cost.seed(*TRUE)
    for tokens, att in shapes(500, seed=7):
        cost.observe(tokens, att, true_time(tokens, att))
    assert steps_to_recover(cost, factor) <= DRIFT_WINDOW + 4
    assert cost.recalibrations == 1


@pytest.mark.parametrize("seeded", [too_slow, too_fast])
def test_after_a_rescale_mixed_steps_recover_the_coefficients(seeded):
    """The rescale keeps the bad calibration's split between the terms (steps of one shape cannot tell it);
    mixed steps then separate the terms. The ridge toward that rescaled prior leaves up to ~2% in one
    coefficient, hence 3% here."""
    cost = seeded()
    assert steps_to_recover(cost) is not None
    for tokens, att in shapes(300, seed=4):
        cost.observe(tokens, att, true_time(tokens, att))
    assert (cost.fixed, cost.per_token, cost.per_context) == pytest.approx(TRUE, rel=0.03)
    assert cost.recalibrations == 1


def test_stalls_on_a_correct_seed_never_rescale():
    """One step in ten at 20x its time: three in four recent steps are never off together: no rescale."""
    cost = CostModel()
    cost.seed(*TRUE)
    observe_with_stalls(cost, 2000, seed=6)
    assert cost.recalibrations == 0
    assert cost.predict(64, 64 * 200) == pytest.approx(true_time(64, 64 * 200), rel=0.1)


PER_ADAPTER = 0.0015      # what each distinct LoRA adapter adds to a step (seconds)


def test_per_adapter_term_is_fitted_from_steps_with_and_without_adapters():
    """Steps of base-model work and of 1-8 adapters mixed: the fit recovers every term, the adapters' too."""
    cost = CostModel()
    rng = random.Random(8)
    for tokens, att in shapes(400, seed=8):
        k = rng.choice([0, 0, 1, 2, 4, 8])
        cost.observe(tokens, att, true_time(tokens, att) + PER_ADAPTER * k, k)
    assert (cost.fixed, cost.per_token, cost.per_context, cost.per_adapter) == \
        pytest.approx(TRUE + (PER_ADAPTER,), rel=0.03)
    assert cost.predict(64, 64 * 200, 8) == pytest.approx(true_time(64, 64 * 200) + 8 * PER_ADAPTER, rel=0.02)
    assert cost.as_dict()["per_adapter_s"] == cost.per_adapter


def test_per_adapter_seed_holds_until_steps_with_adapters_come():
    """The calibration's per-adapter seed is kept through any number of base-model steps (their adapter column is
    zero: nothing to fit it on), and steps with adapters then move it to what they cost."""
    cost = CostModel()
    cost.seed(*TRUE, per_adapter=0.004)
    for tokens, att in shapes(300, seed=9):
        cost.observe(tokens, att, true_time(tokens, att))
    assert cost.per_adapter == 0.004
    assert cost.per_token == pytest.approx(TRUE[1], rel=0.03)
    rng = random.Random(9)
    for tokens, att in shapes(600, seed=10):
        k = rng.choice([0, 2, 8])
        cost.observe(tokens, att, true_time(tokens, att) + PER_ADAPTER * k, k)
    assert cost.per_adapter == pytest.approx(PER_ADAPTER, rel=0.05)
    cost.seed(cost.fixed, cost.per_token, cost.per_context)     # a seed without the term keeps it
    assert cost.per_adapter == pytest.approx(PER_ADAPTER, rel=0.05)


def test_a_rescale_scales_the_per_adapter_term_too():
    """A calibration ten times too fast, adapter term included: the drift check's rescale moves that term too."""
    cost = CostModel()
    cost.seed(*(c / 10 for c in TRUE), per_adapter=PER_ADAPTER / 10)
    for _ in range(DRIFT_WINDOW + 4):
        cost.observe(*DECODE, true_time(*DECODE) + 4 * PER_ADAPTER, 4)
    assert cost.recalibrations == 1
    assert cost.per_adapter > 3 * PER_ADAPTER / 10
    assert cost.predict(*DECODE, 4) == pytest.approx(true_time(*DECODE) + 4 * PER_ADAPTER, rel=0.2)
