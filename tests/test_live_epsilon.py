"""LiveEpsilon: agreement with Opacus's accountants and the direction of every rounding.

The accountant's epsilon may only be at or above Opacus's value, the lower bound only at
or below end_to_end_epsilon's, so rounding never invents a violation.
"""

import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

from lightning_dpaudit.estimators import end_to_end_epsilon
from lightning_dpaudit.estimators.live_epsilon import LiveEpsilon, _round_down, _StepGrid
from lightning_dpaudit.estimators.rdp_curves import _lower_rdp_epsilon, _rdp_curve

DELTA = 1e-5
Q = 64 / 1797
HISTORIES = [
    [(1.0, Q, 100)],
    [(1.1, 0.02, 37)],
    [(1.3, 0.01, 50), (0.9, 0.045, 30), (1.3, 0.01, 5)],
]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GaussianAccountant is experimental; extreme RDP orders
        yield


def _opacus(kind, history):
    from opacus.accountants import create_accountant

    acc = create_accountant(kind)
    acc.history = list(history)
    return float(acc.get_epsilon(delta=DELTA))


# ---------------------------------------------------------------- accountant's epsilon


@pytest.mark.parametrize("history", HISTORIES)
def test_rdp_accountant_epsilon_equals_opacus(history):
    live = LiveEpsilon("rdp", delta=DELTA)
    expected = _opacus("rdp", history)
    assert live.accountant_epsilon(history) == pytest.approx(expected, rel=1e-12)
    assert live.accountant_epsilon(history) == pytest.approx(expected, rel=1e-12)  # from the cache


def test_rdp_accountant_epsilon_follows_a_run_step_by_step():
    from opacus.accountants import RDPAccountant

    acc, live = RDPAccountant(), LiveEpsilon("rdp", delta=DELTA)
    for step in range(1, 61):
        acc.step(noise_multiplier=1.0 if step <= 40 else 1.2, sample_rate=Q)
        if step % 10 == 0:
            assert live.accountant_epsilon(acc.history) == pytest.approx(acc.get_epsilon(delta=DELTA), rel=1e-12)


@pytest.mark.parametrize("history", [[(1.0, Q, 100)], [(1.1, 0.02, 37)], [(0.7, 0.2, 3)], [(3.0, 0.01, 5000)]])
def test_gdp_accountant_epsilon_equals_opacus(history):
    live = LiveEpsilon("gdp", delta=DELTA)
    assert live.accountant_epsilon(history) == pytest.approx(_opacus("gdp", history), rel=1e-9)


@pytest.mark.parametrize("history", [HISTORIES[1], HISTORIES[2]])
def test_prv_accountant_epsilon_equals_opacus_without_the_step_grid(history):
    live = LiveEpsilon("prv", delta=DELTA, prv_steps_resolution=0)
    assert live.accountant_epsilon(history) == pytest.approx(_opacus("prv", history), rel=1e-12)


def test_prv_accountant_epsilon_rounds_steps_up_to_the_grid():
    live = LiveEpsilon("prv", delta=DELTA)  # step grid: every count up to 33, then ~3% apart
    grid = _StepGrid(live.prv_steps_resolution)
    off = next(t for t in range(60, 200) if grid.up(t) != t)
    up = grid.up(off)
    at_grid = live.accountant_epsilon([(1.0, Q, up)])
    assert at_grid == pytest.approx(_opacus("prv", [(1.0, Q, up)]), rel=1e-12)
    assert live.accountant_epsilon([(1.0, Q, off)]) == at_grid
    assert at_grid >= _opacus("prv", [(1.0, Q, off)])
    multi = [(1.3, 0.01, 20), (1.0, Q, off - 20)]
    extended = [(1.3, 0.01, 20), (1.0, Q, up - 20)]
    assert live.accountant_epsilon(multi) == pytest.approx(_opacus("prv", extended), rel=1e-12)
    assert live.accountant_epsilon(multi) >= _opacus("prv", multi)


# ---------------------------------------------------------------- lower bound


def test_rdp_curve_matches_opacus_to_1e_12_in_log_a():
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp

    orders = np.asarray(RDPAccountant.DEFAULT_ALPHAS)
    for q in (1e-4, 0.045, 0.6):
        for sigma in (0.4, 1.0, 3.0, 1000.0):
            ours = _rdp_curve(q, sigma, orders)
            theirs = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(orders))
            assert np.max(np.abs(ours - theirs) * (orders - 1)) < 1e-12, (q, sigma)


@pytest.mark.parametrize("history", HISTORIES)
def test_rdp_lower_bound_is_below_end_to_end_and_within_the_mu_rounding(history):
    live = LiveEpsilon("rdp", delta=DELTA)
    on_grid = _round_down(0.8, live.mu_resolution)  # mu exactly on the grid: no rounding margin
    for mu in (0.05, 0.5, 0.77, 1 / 1.1, 1.0, on_grid, 2.5):
        exact = end_to_end_epsilon(mu, delta=DELTA, history=history, accountant="rdp")
        lower = live.lower_bound_epsilon(mu, history)
        assert lower <= exact
        assert lower >= end_to_end_epsilon(mu / (1 + live.mu_resolution), delta=DELTA, history=history) - 1e-9
        assert lower >= 0.995 * exact


def test_rdp_lower_bound_without_rounding_is_exact_up_to_the_lowering():
    live = LiveEpsilon("rdp", delta=DELTA, mu_resolution=0)
    for mu in (0.3, 0.9, 1.7):
        exact = end_to_end_epsilon(mu, delta=DELTA, history=HISTORIES[0])
        assert exact - 1e-6 <= live.lower_bound_epsilon(mu, HISTORIES[0]) <= exact


def test_rdp_lower_bound_computes_only_the_orders_it_needs_and_still_finds_the_minimum():
    from opacus.accountants import RDPAccountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    from lightning_dpaudit.estimators.rdp_curves import _Curves

    orders = np.asarray(RDPAccountant.DEFAULT_ALPHAS)
    for sigma, steps in ((1.1, 1000), (0.5, 3), (8.0, 20)):
        curves = _Curves(orders)
        lower = _lower_rdp_epsilon(curves, sigma, {Q: steps}, DELTA)
        rdp = compute_rdp(q=Q, noise_multiplier=sigma, steps=steps, orders=list(orders))
        exact, _ = get_privacy_spent(orders=list(orders), rdp=rdp, delta=DELTA)
        assert exact - 1e-7 <= lower <= exact
        assert np.isnan(curves.cache[(sigma, Q)]).any()  # some orders never computed


def test_rdp_lower_bound_follows_a_drifting_mu_below_the_exact_value():
    live = LiveEpsilon("rdp", delta=DELTA)
    for step in range(20, 401, 38):
        mu = 0.95 * (1 - 2 / math.sqrt(step))
        history = [(1.0, Q, step)]
        assert live.lower_bound_epsilon(mu, history) <= end_to_end_epsilon(mu, delta=DELTA, history=history)


@pytest.mark.parametrize("history", [[(1.0, Q, 100)], [(1.1, 0.02, 37)], [(3.0, 0.01, 5000)]])
def test_gdp_lower_bound_equals_end_to_end(history):
    live = LiveEpsilon("gdp", delta=DELTA)
    for mu in (0.2, 0.77, 1.0, 1.6):
        expected = end_to_end_epsilon(mu, delta=DELTA, history=history, accountant="gdp")
        assert live.lower_bound_epsilon(mu, history) == pytest.approx(expected, rel=1e-9)


def test_gdp_outside_opacus_bracket():
    live = LiveEpsilon("gdp", delta=DELTA)
    assert live.lower_bound_epsilon(1e-6, [(1.0, Q, 10)]) == 0.0  # epsilon 0 already meets delta
    assert live.lower_bound_epsilon(40.0, [(1.0, Q, 10)]) == 500.0  # at least the bracket's end
    assert live.accountant_epsilon([(0.02, Q, 10)]) == math.inf


def test_prv_lower_bound_without_grids_equals_end_to_end():
    live = LiveEpsilon("prv", delta=DELTA, prv_mu_resolution=0, prv_steps_resolution=0)
    for history in (HISTORIES[1], HISTORIES[2]):
        expected = end_to_end_epsilon(0.8, delta=DELTA, history=history, accountant="prv")
        assert live.lower_bound_epsilon(0.8, history) == pytest.approx(expected, rel=1e-12)


def test_prv_lower_bound_rounds_mu_and_steps_down():
    live = LiveEpsilon("prv", delta=DELTA)
    grid = _StepGrid(live.prv_steps_resolution)
    off = next(t for t in range(60, 200) if grid.down(t) != t)
    down = grid.down(off)
    mu_grid = _round_down(0.8, live.prv_mu_resolution)
    history = [(1.0, Q, off)]
    lower = live.lower_bound_epsilon(0.8, history)
    rounded = end_to_end_epsilon(mu_grid, delta=DELTA, history=[(1.0, Q, down)], accountant="prv")
    assert lower == pytest.approx(rounded, rel=1e-12)
    assert lower <= end_to_end_epsilon(0.8, delta=DELTA, history=history, accountant="prv")
    # on both grids nothing is rounded: the exact value
    on_grid = [(1.0, Q, down)]
    assert live.lower_bound_epsilon(mu_grid, on_grid) == pytest.approx(
        end_to_end_epsilon(mu_grid, delta=DELTA, history=on_grid, accountant="prv"), rel=1e-12
    )
    # multi-entry: steps are removed from the end
    multi = [(1.3, 0.01, 20), (1.0, Q, off - 20)]
    truncated = [(1.3, 0.01, 20), (1.0, Q, down - 20)]
    expected = end_to_end_epsilon(mu_grid, delta=DELTA, history=truncated, accountant="prv")
    assert live.lower_bound_epsilon(0.8, multi) == pytest.approx(expected, rel=1e-12)
    assert live.lower_bound_epsilon(0.8, multi) <= end_to_end_epsilon(0.8, delta=DELTA, history=multi, accountant="prv")


def test_prv_lower_bound_caps_mu_at_twice_the_claim_and_still_exceeds_the_accountant():
    live = LiveEpsilon("prv", delta=DELTA)
    history = [(1.25, Q, 30)]  # claimed mu 0.8, cap 1.6
    capped = _round_down(2.0 * 0.8, live.prv_mu_resolution)
    lower = live.lower_bound_epsilon(8.0, history)
    assert lower == pytest.approx(end_to_end_epsilon(capped, delta=DELTA, history=history, accountant="prv"), rel=1e-12)
    assert live.accountant_epsilon(history) < lower
    uncapped = LiveEpsilon("prv", delta=DELTA, prv_mu_cap=None)
    assert uncapped.lower_bound_epsilon(1.7, history) > lower


# ---------------------------------------------------------------- grids and edges


@pytest.mark.parametrize("resolution", [0.001, 0.01, 0.03])
def test_round_down_stays_below_and_within_one_grid_step(resolution):
    for mu in np.concatenate([np.geomspace(1e-4, 50, 301), [1.0, 0.5, (1 + resolution) ** 7]]):
        g = _round_down(float(mu), resolution)
        assert g <= mu < g * (1 + resolution) * (1 + 1e-12)
    assert _round_down(0.37, 0.0) == 0.37


def test_step_grid_brackets_every_count_and_is_dense_at_first():
    grid = _StepGrid(0.03)
    for t in range(1, 3000):
        down, up = grid.down(t), grid.up(t)
        assert down <= t <= up and (down == up) == (down == t)
        assert up <= max(down + 1, down * 1.03 + 1)
    assert all(grid.down(t) == t for t in range(1, 34))


def test_edges_and_argument_checks():
    for kind in ("rdp", "gdp", "prv"):
        live = LiveEpsilon(kind, delta=DELTA)
        assert live.lower_bound_epsilon(0.0, [(1.0, Q, 10)]) == 0.0
        assert live.lower_bound_epsilon(math.inf, [(1.0, Q, 10)]) == math.inf
        assert live.lower_bound_epsilon(0.9, []) == 0.0
        assert live.accountant_epsilon([]) == 0.0
        assert live.accountant_epsilon([(1.0, Q, 0)]) == 0.0
        with pytest.raises(ValueError, match="mu_step"):
            live.lower_bound_epsilon(-0.1, [(1.0, Q, 10)])
        with pytest.raises(ValueError, match="history entry"):
            live.accountant_epsilon([(1.0, 1.5, 10)])
    with pytest.raises(ValueError, match="accountant"):
        LiveEpsilon("moments", delta=DELTA)
    with pytest.raises(ValueError, match="delta"):
        LiveEpsilon("rdp", delta=0.0)
    with pytest.raises(ValueError, match="prv_steps_resolution"):
        LiveEpsilon("prv", delta=DELTA, prv_steps_resolution=1.5)
    with pytest.raises(ValueError, match="prv_mu_cap"):
        LiveEpsilon("prv", delta=DELTA, prv_mu_cap=0.5)


def test_live_epsilon_does_not_import_torch():
    code = (
        "import sys; from lightning_dpaudit.estimators.live_epsilon import LiveEpsilon; "
        "LiveEpsilon('rdp', delta=1e-5); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "False"


def _tick():
    warnings.warn("a warning of the user's own, shown once per location", UserWarning)


def test_composing_does_not_show_the_users_once_per_location_warnings_again():
    """warnings.catch_warnings, left, makes Python show every once-per-location warning again; the running
    epsilon is composed at every log step, so it must not use one."""
    from lightning_dpaudit.estimators import end_to_end_epsilon

    end_to_end_epsilon(0.8, delta=1e-5, sample_rate=0.01, steps=200, accountant="prv")  # imports (scipy's and torch's
    # modules use catch_warnings as they load) before the warnings are counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            _tick()
            end_to_end_epsilon(0.8, delta=1e-5, sample_rate=0.01, steps=200, accountant="prv")
    assert sum("of the user's own" in str(w.message) for w in caught) == 1
