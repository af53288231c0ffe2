"""Opacus's noise and clipping schedulers under the audit: alarm, claim segments and tightness.

Digits CNN, sigma 2.0 at the start, default PrivacyAuditor, one thread; each scheduler
stepped after every epoch (29 steps). Tightness is the end-to-end lower bound over the
accountant's epsilon; the first row is the same run with sigma and C fixed.

    .venv/bin/python bench/validity/schedules.py [--steps 1000] [--seed 0]
"""

import time

from _path import harness

import torch
from opacus import schedulers

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

SCHEDULES = {
    "fixed": None,
    "StepNoise(step_size=5, gamma=0.8)": lambda o: schedulers.StepNoise(o, step_size=5, gamma=0.8),
    "ExponentialNoise(gamma=0.97)": lambda o: schedulers.ExponentialNoise(o, gamma=0.97),
    "LambdaNoise(1.5 for 10 epochs, then 1)": lambda o: schedulers.LambdaNoise(
        o, noise_lambda=lambda epoch: 1.5 if epoch < 10 else 1.0),
    "StepGradClip(step_size=5, gamma=0.5)": lambda o: schedulers.StepGradClip(o, step_size=5, gamma=0.5),
    "ExponentialGradClip(gamma=0.9)": lambda o: schedulers.ExponentialGradClip(o, gamma=0.9),
    "LambdaGradClip(1 / (1 + epoch))": lambda o: schedulers.LambdaGradClip(
        o, scheduler_function=lambda epoch: 1.0 / (1 + epoch)),
}


def run(schedule, steps: int, seed: int) -> dict:
    model, optimizer, loader, _ = make_private_digits(noise_multiplier=2.0, seed=seed)
    auditor = PrivacyAuditor(optimizer, seed=seed, on_violation=lambda result: None)
    scheduler = schedule(optimizer) if schedule else None
    done, start = 0, time.perf_counter()
    while done < steps:
        done += train_steps(model, optimizer, loader, min(len(loader), steps - done))
        if scheduler is not None:
            scheduler.step()
    r = auditor.result()
    return {"segments": len(auditor.record.monitor.segments), "alarm": r.first_violation_step,
            "sigma_end": 1 / r.mu_claimed, "eps_lower": r.epsilon_lower_bound, "eps_acc": r.epsilon_accountant,
            "ratio": r.epsilon_lower_bound / r.epsilon_accountant, "seconds": time.perf_counter() - start}


def main() -> None:
    parser = harness.parser(__doc__, steps=1000, seed=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(harness.header("schedule", "segments", "alarm", "sigma at the end", "eps lower / accountant", "ratio"))
    for name, schedule in SCHEDULES.items():
        r = run(schedule, args.steps, args.seed)
        alarm = "none" if r["alarm"] is None else f"step {r['alarm']}"
        print(f"| {name} | {r['segments']} | {alarm} | {r['sigma_end']:.3f} | {r['eps_lower']:.3f} / {r['eps_acc']:.3f} "
              f"| {r['ratio']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
