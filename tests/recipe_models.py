"""The recipes (tests/recipes.py) that bring a model or a loop of their own: a Hugging Face classifier with LoRA,
a DP-GAN, and Lightning Trainers under bf16-mixed precision (one of them the large-batch, augmentation-multiplicity,
EMA recipe)."""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils.data import TensorDataset

from recipe_runs import Audit, loop, private

from lightning_dpaudit.datasets import DigitsCNN, digits_dataset, make_private_digits

CE = nn.CrossEntropyLoss()
VOCAB, TOKENS, CLASSES, ROWS = 64, 8, 3, 512

# ---------------------------------------------------------------------------------------------- BERT with LoRA


def tokens(seed: int) -> TensorDataset:
    """Sequences of random tokens, labelled by their first token (mod the classes), 10% of labels flipped."""
    g = torch.Generator().manual_seed(seed + 7)
    x = torch.randint(1, VOCAB, (ROWS, TOKENS), generator=g)
    y = (x[:, 0] + (torch.rand(ROWS, generator=g) < 0.1).long()) % CLASSES
    return TensorDataset(x, y)


def bert_with_lora(seed: int) -> nn.Module:
    """BertForSequenceClassification from a 2-layer, 32-wide config, LoRA (r 4) on query and value via peft; the
    classifier head made trainable beside the adapters."""
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    base = BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=TOKENS, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["query", "value"], lora_dropout=0.0))
    for p in model.base_model.model.classifier.parameters():
        p.requires_grad_(True)
    return model


def lora_run(seed: int, steps: int, *, head_outside: bool = False):
    """The adapters (and the head) trained by DP-SGD; the twin trains the head with a second plain Adam, given to
    the audit as `other_optimizers` as the plain-loop guide says."""
    model = bert_with_lora(seed)
    head = list(model.base_model.model.classifier.parameters())
    trained = [p for p in model.parameters() if p.requires_grad and (not head_outside or all(p is not h for h in head))]
    module, optimizer, loader = private(model, tokens(seed), seed=seed, params=trained, batch_size=32, lr=0.5)
    others = [torch.optim.Adam(head, lr=1e-2)] if head_outside else []
    loss = lambda batch: CE(module(input_ids=batch[0]).logits, batch[1])  # noqa: E731
    audit = Audit(optimizer, module=module, loader=loader, seed=seed, loss=loss, other_optimizers=others)

    def step(batch):
        for opt in [optimizer, *others]:
            opt.zero_grad()
        loss(batch).backward()
        for opt in [optimizer, *others]:
            opt.step()

    loop(step, loader, steps, audit.alarmed)
    return audit.result()


# ---------------------------------------------------------------------------------------------- DP-GAN

LATENT = 16


def dp_gan_run(seed: int, steps: int, *, generator_sees_data: bool = False):
    """Opacus's DCGAN recipe on the digits (as 64 pixels): the discriminator trained by DP-SGD on a real batch and
    as many generated samples (one backward pass of both losses), the generator by plain Adam through the
    discriminator's output on generated samples. The twin adds to the generator's loss a term on the private batch
    (generated samples pulled towards the real ones)."""
    torch.manual_seed(seed)
    discriminator = nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    generator = nn.Sequential(nn.Linear(LATENT, 64), nn.ReLU(), nn.Linear(64, 64), nn.Sigmoid(), nn.Unflatten(1, (1, 8, 8)))
    module, optimizer, loader = private(discriminator, digits_dataset(), seed=seed, lr=0.1)
    plain = torch.optim.Adam(generator.parameters(), lr=2e-3)
    bce = nn.BCEWithLogitsLoss()
    g = torch.Generator().manual_seed(seed + 9)
    audit = Audit(optimizer, module=nn.ModuleDict({"discriminator": module, "generator": generator}), loader=loader,
                  seed=seed, other_optimizers=[plain])

    def step(batch):
        real = batch[0]
        fake = generator(torch.randn(real.shape[0], LATENT, generator=g))
        optimizer.zero_grad(set_to_none=True)
        real_out, fake_out = module(real).squeeze(1), module(fake.detach()).squeeze(1)
        (bce(real_out, torch.ones_like(real_out)) + bce(fake_out, torch.zeros_like(fake_out))).backward()
        optimizer.step()
        plain.zero_grad()
        optimizer.zero_grad(set_to_none=True)
        out = module(fake).squeeze(1)
        loss = bce(out, torch.ones_like(out))
        if generator_sees_data:
            loss = loss + nn.functional.mse_loss(fake, real)
        loss.backward()
        plain.step()
        optimizer.zero_grad(set_to_none=True)  # the discriminator's gradients from the generator's pass dropped

    loop(step, loader, steps, audit.alarmed)
    return audit.result()


# ---------------------------------------------------------------------------------------------- Lightning


def lightning_run(seed: int, steps: int, *, second_optimizer: bool = False):
    """The digits CNN made private by make_private_digits, under a Trainer with precision="bf16-mixed" and
    DPAuditCallback. The twin's LightningModule also returns a plain Adam over the classifier from
    configure_optimizers (two optimizers: manual optimization) and leaves that layer out of the DP optimizer."""
    import pytorch_lightning as pl

    pl.seed_everything(seed, verbose=False)
    if second_optimizer:
        model = DigitsCNN()
        head = list(model.classifier[3].parameters())
        body = [p for p in model.parameters() if all(p is not h for h in head)]
        model, optimizer, loader = private(model, digits_dataset(), seed=seed, params=body)
        plain = torch.optim.Adam(head, lr=1e-3)
    else:
        model, optimizer, loader, _ = make_private_digits(seed=seed)
        plain = None

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.automatic_optimization = plain is None

        def training_step(self, batch, batch_idx):
            loss = CE(self.model(batch[0]), batch[1])
            if self.automatic_optimization:
                return loss
            for opt in self.optimizers():
                opt.zero_grad()
            self.manual_backward(loss)
            for opt in self.optimizers():
                opt.step()
            return loss

        def configure_optimizers(self):
            return optimizer if plain is None else [optimizer, plain]

    return fit_audited(Classifier(), loader, seed, steps)


def best_recipe_run(seed: int, steps: int, *, views_as_records: bool = False):
    """The recipe behind the best published DP-SGD accuracies on a user's own Trainer: a large batch (256 expected,
    Poisson), augmentation multiplicity (VIEWS views of each record in one forward pass, the per-sample gradients
    averaged over each record's views in on_before_optimizer_step), an EMA of the iterates by Lightning's own
    EMAWeightAveraging callback, precision="bf16-mixed", DPAuditCallback beside it. The twin leaves the views'
    gradients unaveraged: each view clipped as a record."""
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import EMAWeightAveraging

    pl.seed_everything(seed, verbose=False)
    model, optimizer, loader = private(DigitsCNN(), digits_dataset(), seed=seed, batch_size=4 * 64, lr=1.0)

    class AugMult(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.records = 0

        def training_step(self, batch, batch_idx):
            images, labels = batch
            self.records = len(images)
            return CE(self.model(views_of(images)), labels.repeat_interleave(VIEWS))

        def on_before_optimizer_step(self, optimizer):
            if views_as_records:
                return
            for p in self.model.parameters():
                if getattr(p, "grad_sample", None) is not None:
                    p.grad_sample = p.grad_sample.view(self.records, VIEWS, *p.shape).mean(dim=1)

        def configure_optimizers(self):
            return optimizer

    return fit_audited(AugMult(), loader, seed, steps, callbacks=[EMAWeightAveraging(decay=0.999)])


VIEWS = 4


def views_of(images: torch.Tensor) -> torch.Tensor:
    """VIEWS views of each image, consecutive (random flips and one-pixel shifts, drawn from torch's generator)."""
    views = [images] + [torch.roll(images.flip(-1) if torch.rand(()) < 0.5 else images,
                                   shifts=tuple(torch.randint(-1, 2, (2,)).tolist()), dims=(-2, -1))
                        for _ in range(VIEWS - 1)]
    return torch.stack(views, dim=1).reshape(len(images) * VIEWS, *images.shape[1:])


def fit_audited(module, loader, seed: int, steps: int, *, callbacks=()):
    """Trainer(precision="bf16-mixed") with DPAuditCallback after `callbacks`, stopped at the first alarm, Lightning's
    and the package's loggers quiet for this run only; the audit's result."""
    import pytorch_lightning as pl

    from lightning_dpaudit import DPAuditCallback

    loggers = [logging.getLogger(name) for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric",
                                                     "lightning_dpaudit")]
    levels = [logger.level for logger in loggers]  # quiet for this run only: later tests read these loggers
    for logger in loggers:
        logger.setLevel(logging.ERROR)

    class StopAtAlarm:
        trainer = None

        def __call__(self, result):
            self.trainer.should_stop = True

    alert = StopAtAlarm()
    callback = DPAuditCallback(seed=seed, report=False, alert=alert)
    trainer = pl.Trainer(max_steps=steps, callbacks=[*callbacks, callback], precision="bf16-mixed", accelerator="cpu",
                         logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False)
    alert.trainer = trainer
    try:
        trainer.fit(module, loader)
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
    return callback.auditor.result()
