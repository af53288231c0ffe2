"""Size of the auditor's saved state as the run grows (what every Lightning checkpoint carries).

Digits CNN, batch 64, default auditor; `torch.save(auditor.state_dict())` in the form the
callback checkpoints it, after each of the given step counts in one run.

    .venv/bin/python bench/cost/state_size.py [--steps 600 2400]
"""

import io
import warnings

from _path import harness

import torch

from lightning_dpaudit.engine.auditor import PrivacyAuditor
from lightning_dpaudit.integrations.logged_values import _to_checkpoint
from lightning_dpaudit.integrations.digits import make_private_digits, train_steps


def saved_bytes(auditor) -> int:
    buffer = io.BytesIO()
    torch.save(_to_checkpoint(auditor.state_dict()), buffer)
    return buffer.tell()


def main():
    parser = harness.parser(__doc__)
    parser.add_argument("--steps", type=int, nargs="+", default=[600, 2400])
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, seed=0)
    print(f"canaries/step={auditor.options.canaries_per_step}")
    print(harness.header("steps", "saved state (MB)", "of which noise fingerprints (kB)"))
    done = 0
    for target in sorted(args.steps):
        train_steps(model, optimizer, loader, target - done)
        done = target
        fingerprints = auditor.recorded().fingerprints.state_dict()["fingerprints"].nbytes
        print(f"| {done} | {saved_bytes(auditor) / 2**20:.2f} | {fingerprints / 1024:.1f} |", flush=True)


if __name__ == "__main__":
    main()
