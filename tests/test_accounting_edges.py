"""The accountant's epsilon at the edges of what an accountant's history may hold: a step without noise, a noise
multiplier too small for Opacus's PRV accountant. The result reports inf (no noise: no privacy) or nan with a note
saying why; it never raises, and numpy's floating-point warnings from the accountant's maths stay inside."""

import math
import warnings

import pytest

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps


def _audited(accountant: str):
    """A short audit of the digits CNN under Opacus's `accountant`, with the accountant make_private attached."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")
        warnings.filterwarnings("ignore", message=".*GDP accounting is experimental.*")
        model, optimizer, loader, engine = make_private_digits(seed=0, accountant=accountant)
    auditor = PrivacyAuditor(optimizer, seed=1, canaries_per_step=64)
    train_steps(model, optimizer, loader, 2)
    return auditor, engine.accountant


def _result_without_numpy_warnings(auditor):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = auditor.result()
    numpy_warnings = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    assert not numpy_warnings, [str(w.message) for w in numpy_warnings]
    return result


@pytest.mark.parametrize("accountant", ["prv", "rdp"])
@pytest.mark.parametrize("where", [0, None])
def test_a_step_without_noise_in_the_history_gives_an_infinite_accountant_epsilon(accountant, where):
    """A noiseless run's entry (a checkpoint loaded into the accountant) first or last: Opacus's PRV accountant
    raises OverflowError there; the truth is epsilon = inf, and the audit's own bound is still computed."""
    auditor, composed = _audited(accountant)
    entry = (0.0, composed.history[-1][1], 3)
    composed.history.insert(len(composed.history) if where is None else where, entry)
    result = _result_without_numpy_warnings(auditor)
    assert result.epsilon_accountant == math.inf
    assert math.isfinite(result.epsilon_lower_bound) and result.epsilon_lower_bound > 0
    assert not any(note.startswith("accounting:") for note in result.notes)


def test_a_gaussian_accountant_whose_last_step_had_no_noise_reports_an_infinite_epsilon():
    auditor, composed = _audited("gdp")
    composed.history.append((0.0, composed.history[-1][1], 3))
    assert _result_without_numpy_warnings(auditor).epsilon_accountant == math.inf


def test_a_noise_multiplier_the_prv_accountant_cannot_compose_gives_nan_with_a_note_not_an_error():
    """At noise multiplier 1e-9 Opacus's PRV accountant would discretise the privacy loss on more points than numpy
    can allocate (ValueError): the accountant's epsilon is not available, and the note says why."""
    auditor, composed = _audited("prv")
    composed.history.insert(0, (1e-9, composed.history[-1][1], 3))
    result = _result_without_numpy_warnings(auditor)
    assert math.isnan(result.epsilon_accountant)
    assert math.isfinite(result.epsilon_lower_bound)
    notes = [note for note in result.notes if note.startswith("accounting:")]
    assert len(notes) == 1
    assert re_search(r"the accountant's epsilon is not available \(nan\): computing it from the accountant's history "
                     r"raised ValueError: .*; the smallest noise multiplier in its history is 1e-09", notes[0])
    assert "accounting: the accountant's epsilon is not available" in str(result)  # the summary shows the note
    assert auditor.result().notes == result.notes  # asked again: one note, not one more per call


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


# ---- long histories: consecutive equal entries are composed once


_RUNS = [(1.0, 0.05, 1)] * 40 + [(1.3, 0.05, 2)] * 30 + [(1.0, 0.05, 1)] * 20 + [(1.0, 0.08, 1)] * 10


def test_merging_consecutive_equal_entries_keeps_their_order_and_sums_their_steps():
    from lightning_dpaudit.estimators.live_epsilon import merge_history

    assert merge_history(_RUNS) == [(1.0, 0.05, 40), (1.3, 0.05, 60), (1.0, 0.05, 20), (1.0, 0.08, 10)]
    assert merge_history([]) == []


@pytest.mark.parametrize("kind", ["rdp", "prv"])
def test_a_merged_history_gives_the_epsilon_of_the_whole_one(kind):
    """Opacus's own accountant on the 100 entries and on the 4 merged ones: the same composition, the same epsilon
    (to the last bits of the sums), and the live value (the PRV step grid off) is the merged one's."""
    from opacus.accountants import create_accountant

    from lightning_dpaudit.estimators.live_epsilon import LiveEpsilon, merge_history

    whole, merged = create_accountant(kind), create_accountant(kind)
    whole.history, merged.history = list(_RUNS), merge_history(_RUNS)
    epsilon = whole.get_epsilon(delta=1e-5)
    assert merged.get_epsilon(delta=1e-5) == pytest.approx(epsilon, rel=1e-9)
    live = LiveEpsilon(kind, delta=1e-5, prv_steps_resolution=0).accountant_epsilon(_RUNS)
    assert live == pytest.approx(epsilon, rel=1e-9)


def test_the_audit_asks_a_prv_accountant_with_a_long_history_for_the_merged_one():
    """3,000 entries of one step each (a history restored entry by entry): Opacus's PRV accountant would discretise
    and compose each (minutes); the audit reports the merged history's epsilon, which is the whole one's."""
    from opacus.accountants import create_accountant

    auditor, composed = _audited("prv")
    q = composed.history[-1][1]
    composed.history = [(1.0, q, 1)] * 3000
    reference = create_accountant("prv")
    reference.history = [(1.0, q, 3000)]
    assert auditor.result().epsilon_accountant == pytest.approx(reference.get_epsilon(delta=1e-5), rel=1e-9)


def test_a_prv_composition_too_large_for_memory_is_refused_with_a_note():
    """300,000 steps at noise multiplier 1: Opacus's PRV accountant would discretise on some 1e8 points (tens of GB)."""
    auditor, composed = _audited("prv")
    composed.history = [(1.0, composed.history[-1][1], 1)] * 300_000
    result = auditor.result()
    assert math.isnan(result.epsilon_accountant) and math.isnan(result.epsilon_lower_bound)
    assert re_search(r"accounting: the accountant's epsilon is not available \(nan\): .*ValueError: the PRV accountant "
                     r"would discretise [\d,]+ steps on .* points, above the bound of 8,388,608 points",
                     "\n".join(result.notes))


def test_the_scaled_rdp_lower_bound_from_the_vectorized_curves_stays_below_opacus_and_close_to_it():
    """Under a claim that changed, every entry at sigma_t / ratio: composed from the lowered vectorized curves, never
    above Opacus's RDP epsilon of the same entries and within the ratio's rounding (0.1%) of it."""
    from opacus.accountants import RDPAccountant

    from lightning_dpaudit.estimators.live_epsilon import LiveEpsilon

    history = [(1.0 * 1.02 ** k, 0.036, 1 + k % 3) for k in range(250)]
    ratio = 1.7
    exact = RDPAccountant()
    exact.history = [(s / ratio, q, n) for s, q, n in history]
    reference = exact.get_epsilon(delta=1e-5)
    lower = LiveEpsilon("rdp", delta=1e-5).lower_bound_epsilon_scaled(ratio, history)
    assert reference * 0.99 < lower <= reference
