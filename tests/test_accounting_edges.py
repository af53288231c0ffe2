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
