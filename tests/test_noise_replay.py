"""Noise that replays an earlier step's noise is caught however far back, across resumes too.

A tiny model keeps 5,000 steps fast. Opacus draws each step's noise from the optimizer's
generator; re-seeding it (as a run resumed under a fixed seed does) replays the noise of
the steps after the seed. Under fresh noise the repeat test's false-alarm probability
is at most 1e-6 for the whole run.
"""

import warnings

import torch
from opacus import PrivacyEngine

from lightning_dpaudit import PrivacyAuditor

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
NOISE_SEED = 7


def _private(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 10)
    data = torch.utils.data.TensorDataset(torch.randn(256, 32), torch.randint(0, 10, (256,)))
    model, opt, loader = PrivacyEngine().make_private(
        module=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        data_loader=torch.utils.data.DataLoader(data, batch_size=16, generator=torch.Generator().manual_seed(1)),
        noise_multiplier=1.0, max_grad_norm=1.0, noise_generator=torch.Generator().manual_seed(NOISE_SEED),
    )
    return model, opt, loader


def _train(model, opt, loader, steps, *, reseed_at=None):
    done = 0
    while True:
        for x, y in loader:
            if done == reseed_at:
                opt.generator.manual_seed(NOISE_SEED)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                return


def test_a_replay_5000_steps_back_is_flagged_and_named():
    model, opt, loader = _private()
    auditor = PrivacyAuditor(opt, seed=0, on_violation=lambda r: None)
    _train(model, opt, loader, 5005, reseed_at=5000)
    result = auditor.result(accounting=False)
    assert result.first_noise_repeat == (5001, 1)
    assert result.noise_repeats == 5 and result.first_violation_step == 5001
    assert "noise repeats" in result.violating_layers


def test_a_replay_of_steps_before_a_checkpoint_is_flagged_after_resuming():
    model, opt, loader = _private()
    first = PrivacyAuditor(opt, seed=0, on_violation=lambda r: None)
    _train(model, opt, loader, 700)
    state = first.state_dict()
    assert not first.result(accounting=False).violation
    first.detach()
    # resumed under the same fixed seed, without the generator's state: step 701 replays step 1
    model, opt, loader = _private()
    resumed = PrivacyAuditor(opt, seed=0, on_violation=lambda r: None)
    resumed.load_state_dict(state)
    _train(model, opt, loader, 3)
    result = resumed.result(accounting=False)
    assert result.first_noise_repeat == (701, 1) and result.noise_repeats == 3
    assert result.violation and result.first_violation_step == 701
