"""The bug zoo against the auditor at default settings: when does the alarm fire?

"first alarm" is the step the violation is recorded at (the step a check after every step
finds it); with check_every="auto" (8 steps on one process) it is raised at the next check,
where training stops ("raised at").

    .venv/bin/python bench/validity/bug_zoo.py [--steps 1000] [--seed 0] [--canary dirac] [--canaries auto] [--bugs NAME ...]
"""

import warnings

from _path import harness

from lightning_dpaudit.bugs import BUGS
from lightning_dpaudit.testing import train_audited

SIGMA = {"wrong-noise": 3.0}  # Violation 3 of Tight Auditing: claims 3.0, applies 2.5


def main():
    parser = harness.parser(__doc__, steps=1000, seed=0)
    parser.add_argument("--canary", default="dirac", help="canary kind (gradient or input)")
    harness.flags(parser, canaries="auto")
    parser.add_argument("--bugs", nargs="+", choices=list(BUGS), default=None,
                        help="only these bugs, without the correct run (default: the correct run and every bug)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(harness.header("bug", "claimed sigma", "first alarm (step)", "raised at", "violating",
                         "mu anytime / claimed"))
    for bug in args.bugs or [None, *BUGS]:
        from lightning_dpaudit.bugs import inject_bug

        sigma = SIGMA.get(bug, 1.0)
        r = train_audited(
            steps=args.steps, noise_multiplier=sigma, seed=args.seed, stop_on_violation=True,
            canary=args.canary, canaries_per_step=args.canaries, check_every="auto",
            transform=(lambda opt, b=bug: inject_bug(opt, b)) if bug else None,
        )
        first, raised = (r.first_violation_step, r.steps) if r.violation else (f"none in {r.steps}", "-")
        print(f"| {bug or '(correct Opacus)'} | {sigma:g} | {first} | {raised} | {', '.join(r.violating_layers) or '-'} | "
              f"{r.mu_lower_bound_anytime:.3f} / {r.mu_claimed:.3f} |", flush=True)


if __name__ == "__main__":
    main()
