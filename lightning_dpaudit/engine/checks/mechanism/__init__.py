"""Checks of the mechanism beyond the canaries: what the accountant composed, the replicas, ghost clipping's own
code, and the set-up facts read when the audit attaches.

    accountant.py      every released step composed by the accountant, with the noise it used
    replicas.py        every replica of a data-parallel run holds the same parameters
    ghost_clipping.py  ghost clipping's norms and coefficients, as the canaries' rows went through them
    setup.py           the noise reconciled over processes, the sample rate over ranks, the update's normalisation
"""
