"""Probe cases: the Lightning callback (DPAuditCallback), its options, fits and resumed checkpoints."""

from __future__ import annotations

import os
import tempfile
import warnings

from .common import Case, HANDLED, NAN, REFUSED, judge_run, private, quiet, refusal, show, staged


def callback_cases():
    cases = []
    bad = [
        ("alert", "email"), ("alert", None), ("alert", 1), ("alert", lambda: 1),
        ("log_every_n_steps", 0), ("log_every_n_steps", -1), ("log_every_n_steps", 1.5), ("log_every_n_steps", True),
        ("log_every_n_steps", None), ("log_every_n_steps", "10"),
        ("logging_budget", 0), ("logging_budget", -0.1), ("logging_budget", 1.5), ("logging_budget", NAN),
        ("logging_budget", "0.02"), ("report", 1), ("report", None), ("checkpoint_noise_generator", "yes"),
        ("final_model_canaries", 5), ("final_model_canaries", "ood"), ("final_model_every_n_epochs", 0),
        ("final_model_every_n_epochs", 1.5), ("accountant", "rdp"), ("optimizer", 5), ("optimizer", "sgd"),
        ("delta", 0), ("confidence", 2), ("canary", "nope"), ("canaries_per_step", 1), ("mode", "x"),
        ("seed", -3), ("observation_window", 0), ("check_every", 0), ("bogus_option", 1), ("module", "model"),
    ]
    for name, value in bad:
        expect = REFUSED
        cases.append(Case(f"callback/{name}={show(value)}", "callback options", expect,
                          _callback_build({name: value}, [name])))
    good = [
        ("default", {}), ("log_every_n_steps=1", {"log_every_n_steps": 1}),
        ("log_every_n_steps=10**9", {"log_every_n_steps": 10**9}), ("logging_budget=1", {"logging_budget": 1.0}),
        ("logging_budget=1e-9", {"logging_budget": 1e-9}), ("report=False", {"report": False}),
        ("alert=raise", {"alert": "raise"}), ("alert=stop", {"alert": "stop"}), ("alert=callable", {"alert": print}),
        ("canary=random", {"canary": "random"}), ("mode=paired", {"mode": "paired"}),
        ("observe_steps=1", {"observe_steps": 1}), ("check_every=10**9", {"check_every": 10**9}),
    ]
    for label, options in good:
        cases.append(Case(f"callback-fit/{label}", "callback fit", HANDLED, _callback_fit(options)))
    cases.append(Case("callback-fit/optimizer=plain SGD", "callback fit", "late", _callback_fit({}, plain=True)))
    cases.append(Case("callback-fit/optimizer=other DPOptimizer", "callback fit", "late", _callback_fit({}, foreign=True)))
    cases.append(Case("callback-fit/checkpoint resume", "checkpoints", HANDLED, _callback_resume(None)))
    for label, corrupt in [("state=None", lambda s: None), ("state=[]", lambda s: []),
                           ("state missing auditor", lambda s: {k: v for k, v in s.items() if k != "auditor"}),
                           ("state=str", lambda s: "x"), ("auditor state damaged", _damage_auditor_state)]:
        cases.append(Case(f"checkpoint/{label}", "checkpoints", REFUSED, _callback_resume(corrupt)))
    return cases


def _damage_auditor_state(state):
    state = dict(state)
    for key, value in state.items():
        if isinstance(value, dict) and "steps" in value:
            state[key] = {**value, "steps": -5}
    return state


def _callback_build(options, names):
    def run():
        quiet()
        from lightning_dpaudit import DPAuditCallback

        return refusal(lambda: DPAuditCallback(**options), names)
    return run


def _lightning_parts():
    import pytorch_lightning as pl
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, Subset

    from lightning_dpaudit.integrations.digits import DigitsCNN, digits_dataset

    from opacus.data_loader import DPDataLoader
    from opacus.lightning import DPLightningDataModule

    class Shuffled(pl.LightningDataModule):
        def train_dataloader(self):
            return DataLoader(Subset(digits_dataset(), range(256)), batch_size=64, shuffle=True,
                              generator=torch.Generator().manual_seed(0))

    def Digits():  # Poisson sampling at the accountant's rate, as a correct DP run draws its batches (seeded)
        return DPLightningDataModule(Shuffled(), generator=torch.Generator().manual_seed(0))

    class Private(pl.LightningModule):
        def __init__(self, plain=False):
            super().__init__()
            torch.manual_seed(0)
            self.model = DigitsCNN()
            self.plain = plain

        def forward(self, x):
            return self.model(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self.model(batch[0]), batch[1])

        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            if self.plain:
                return optimizer
            loader = self.trainer.datamodule.train_dataloader()
            _, optimizer, _ = PrivacyEngine().make_private(
                module=self, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0,
                poisson_sampling=isinstance(loader, DPDataLoader), noise_generator=torch.Generator().manual_seed(1))
            return optimizer

    return pl, Digits, Private


def _trainer(pl, root, steps, callbacks, **kwargs):
    return pl.Trainer(max_steps=steps, callbacks=callbacks, logger=False, default_root_dir=root,
                      enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                      accelerator="cpu", **kwargs)


def _callback_fit(options, plain=False, foreign=False):
    def run():
        quiet()
        import logging

        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
        from lightning_dpaudit import DPAuditCallback

        pl, Digits, Private = _lightning_parts()
        root = tempfile.mkdtemp()
        steps = 4
        reference_module = Private(plain=plain)
        pl.seed_everything(0, verbose=False)
        _trainer(pl, root + "/plain", steps, []).fit(reference_module, datamodule=Digits())
        reference = [p.detach().clone() for p in reference_module.parameters()]
        names = ["optimizer", "DPOptimizer", "Opacus"]

        def setup():
            extra = {}
            if foreign:
                extra["optimizer"] = private()[1]
            return DPAuditCallback(**options, **extra)

        def use(callback):
            module = Private(plain=plain)
            pl.seed_everything(0, verbose=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = _trainer(pl, root + "/audited", steps, [callback])
                trainer.fit(module, datamodule=Digits())
            return module, trainer

        def check(callback, info):
            module, trainer = info
            if plain or foreign:
                return "silent-wrong", f"fit ran {trainer.global_step} steps with the audit of another optimizer"
            auditor = callback.auditor
            if auditor is None:
                return "silent-wrong", "no auditor after fit"
            cls, how = judge_run(auditor, module, reference, steps, names, observed=options.get("observe_steps") != 0)
            report = [os.path.join(d, f) for d, _, fs in os.walk(root + "/audited") for f in fs if f == "audit_report.json"]
            if cls == "handled" and options.get("report", True) and not report:
                return "silent-wrong", "no audit_report.json written"
            return cls, how

        return staged(setup, use, check, names)
    return run


def _callback_resume(corrupt):
    def run():
        quiet()
        import logging

        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        from lightning_dpaudit import DPAuditCallback

        pl, Digits, Private = _lightning_parts()
        root = tempfile.mkdtemp()
        callback = DPAuditCallback(seed=0)
        pl.seed_everything(0, verbose=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = _trainer(pl, root, 3, [callback])
            trainer.fit(Private(), datamodule=Digits())
        state = callback.state_dict()
        fresh = DPAuditCallback(seed=0)
        names = ["state", "checkpoint", "steps", "auditor", "dict", "damaged"]

        def setup():
            return fresh.load_state_dict(state if corrupt is None else corrupt(state))

        def use(_):
            pl.seed_everything(0, verbose=False)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                trainer = _trainer(pl, root + "/resumed", 2, [fresh])
                trainer.fit(Private(), datamodule=Digits())
            return trainer

        def check(_, trainer):
            result = fresh.auditor.result(accounting=False)
            if corrupt is not None:
                return "silent-wrong", f"damaged state accepted; resumed audit has {result.steps} steps"
            if result.audit_failed or result.steps != 5:
                return "silent-wrong", f"resumed: steps {result.steps}, failed {result.audit_failed}"
            return "handled", "resumed: 3 + 2 steps audited"

        return staged(setup, use, check, names)
    return run
