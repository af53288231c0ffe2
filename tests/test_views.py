"""Records made of several views (augmentation multiplicity): the exact check compares per record.

Deterministic (fixed seeds); no false-failure rate."""

from __future__ import annotations

import pytest
import torch

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.datasets import make_private_digits

K = 4
STEPS = 6


def augmult_run(grouping: str, average: bool = True):
    """The digits CNN trained on K views of each record; Opacus's per-sample gradients averaged over each record's
    views before the step (one row per record), the views grouped consecutively or in blocks."""
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, data_loader=loader, seed=0, per_sample_check_every=2,
                             per_sample_check_budget=1.0, on_violation=lambda result: None)
    done = 0
    for images, labels in loader:
        if done == STEPS:
            break
        records = images.shape[0]
        views = torch.stack([images, images.flip(-1), images + 0.1, images.flip(-2)], dim=1)  # (records, K, ...)
        if grouping == "consecutive":
            inputs, targets = views.reshape(records * K, *images.shape[1:]), labels.repeat_interleave(K)
        else:
            inputs, targets = views.transpose(0, 1).reshape(K * records, *images.shape[1:]), labels.repeat(K)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), targets).backward()
        for p in model.parameters():
            if average and grouping == "consecutive":
                p.grad_sample = p.grad_sample.view(records, K, *p.shape).mean(dim=1)
            elif average:
                p.grad_sample = p.grad_sample.view(K, records, *p.shape).mean(dim=0)
        optimizer.step()
        done += 1
    result = auditor.result()
    auditor.detach()
    return model, result


@pytest.mark.parametrize("grouping", ["consecutive", "blocks"])
def test_records_of_several_views_are_compared_per_record_and_quiet(grouping):
    _, result = augmult_run(grouping)
    assert not result.violation and result.findings == ()
    assert result.data_path.startswith("3 step(s) compared, every 2 from step 1"), result.data_path
    assert f"records of {K} views compared per record" in result.data_path


def test_views_counted_as_records_are_rows_beyond_the_records():
    _, result = augmult_run("consecutive", average=False)
    codes = [f.code for f in result.findings]
    assert result.violation and codes[0] == "multiplicity", codes
    import re

    rows, records = map(int, re.search(r"clipped (\d+) rows at step \d+ for the (\d+) records", result.findings[0].message).groups())
    assert rows == K * records and "a record became several rows" in result.findings[0].message


def test_views_grouped_another_way_are_declined_not_flagged(monkeypatch):
    from lightning_dpaudit.engine import per_sample_check

    def another_grouping(example, records, k):  # the user's grouping is neither of the two the check tries
        return [("shuffled", (example + 1) % records, [(example + 1) % (records * k)] * k)]

    monkeypatch.setattr(per_sample_check, "groupings", another_grouping)
    _, result = augmult_run("consecutive")
    assert not result.violation and result.findings == ()
    assert "nothing compared yet (records of 4 views: neither consecutive views nor view blocks" in result.data_path


def test_the_audit_leaves_an_augmult_run_as_plain_opacus():
    audited, _ = augmult_run("consecutive")
    model, optimizer, loader, _ = make_private_digits(seed=0)
    done = 0
    for images, labels in loader:
        if done == STEPS:
            break
        records = images.shape[0]
        views = torch.stack([images, images.flip(-1), images + 0.1, images.flip(-2)], dim=1)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(views.reshape(records * K, *images.shape[1:])),
                                          labels.repeat_interleave(K)).backward()
        for p in model.parameters():
            p.grad_sample = p.grad_sample.view(records, K, *p.shape).mean(dim=1)
        optimizer.step()
        done += 1
    assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(audited.parameters(), model.parameters()))
