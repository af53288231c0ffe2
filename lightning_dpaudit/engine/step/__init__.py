"""One audited step, from the optimizer's step to the alarm.

    pipeline.py      plant -> release -> read -> record -> check
    noised_step.py   what the optimizer's add_noise does while the audit is attached
    opacus_step.py   the optimizer's step, watched: Opacus's own errors passed on unchanged
    readings.py      the readings of the steps since the last check, kept where they were computed
    divergence.py    training that diverged (a non-finite parameter, gradient or release)
"""
