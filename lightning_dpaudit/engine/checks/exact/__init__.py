"""The exact checks of the data path: a few real examples replayed through plain autograd at chosen steps.

    per_sample.py           the check: per-sample gradients (ghost: norms and coefficients) against plain autograd
    accumulation.py         the clipped sum accumulated across physical batches, at the pool coordinates
    forward_replay.py       what is kept of a forward pass, and how it is replayed
    sharded_replay.py       the replays under FSDP2, from the gathered tensors
    views.py                records made of several views (augmentation multiplicity), compared per record
    gradient_comparison.py  the sentences for a difference
    budget.py               the exact checks' share of the run's wall time
"""
