"""Real model families, built from small random-initialised configs (never downloaded weights), for the audit to run on.

Each family gives a model, a dataset (a TensorDataset of inputs and targets) and the training step's loss as
users write it (Hugging Face models called the way their docs show, the loss read from the output object, a
tuple or a dict). Used by tests/test_real_models.py and bench/validity/real_models.py.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
warnings.filterwarnings("ignore", message=".*Secure RNG turned off.*")

VOCAB, TOKENS, CLASSES, ROWS = 64, 8, 3, 256
MODES = ("hooks", "functorch", "ew", "ghost")


@dataclass
class Family:
    name: str
    build: Callable[[], nn.Module]  # the model, under the caller's seed
    data: Callable[[torch.Generator], TensorDataset]
    loss: Callable[[nn.Module, tuple, Callable], torch.Tensor]  # the step's loss: (model, batch, cross-entropy)
    needs: str = ""  # the optional package it needs


def _tokens(g, targets: str = "tokens") -> TensorDataset:
    x = torch.randint(1, VOCAB, (ROWS, TOKENS), generator=g)
    y = x.clone() if targets == "tokens" else torch.randint(0, CLASSES, (ROWS,), generator=g)
    return TensorDataset(x, y)


def _images(g, channels: int = 3, side: int = 16) -> TensorDataset:
    return TensorDataset(torch.randn(ROWS, channels, side, side, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g))


def cross_entropy(logits, target, shape=None):
    """The cross-entropy the loops use outside ghost clipping (ghost clipping passes Opacus's criterion instead)."""
    return F.cross_entropy(logits, target)


def _lm_loss(model, batch, ce):
    """Next-token prediction, from the output object's logits; one sequence is one record."""
    x, y = batch
    logits = model(input_ids=x).logits[:, :-1]
    return ce(logits.reshape(-1, logits.shape[-1]), y[:, 1:].reshape(-1), shape=logits.shape)


def _seq2seq_loss(model, batch, ce):
    """The encoder reads x, the decoder predicts y (teacher forcing from the shifted targets)."""
    x, y = batch
    decoder_inputs = torch.cat([torch.zeros_like(y[:, :1]), y[:, :-1]], dim=1)
    logits = model(input_ids=x, decoder_input_ids=decoder_inputs).logits
    return ce(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), shape=logits.shape)


def _classifier_loss(key: str = "input_ids"):
    def loss(model, batch, ce):
        x, y = batch
        return ce(model(**{key: x}).logits, y)
    return loss


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=TOKENS, n_embd=32, n_layer=2, n_head=2,
                                      attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=TOKENS,
                                        tie_word_embeddings=True))


def _bert():
    from transformers import BertConfig, BertForSequenceClassification

    return BertForSequenceClassification(BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                    num_attention_heads=2, intermediate_size=64,
                                                    max_position_embeddings=TOKENS, num_labels=CLASSES,
                                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _t5():
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=16, d_ff=64, num_layers=2,
                                               num_heads=2, dropout_rate=0.0, decoder_start_token_id=0))


def _lora(base: Callable, targets: list):
    def build():
        from peft import LoraConfig, get_peft_model

        return get_peft_model(base(), LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    return build


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                               num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                               num_labels=CLASSES, hidden_dropout_prob=0.0,
                                               attention_probs_dropout_prob=0.0))


def _convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification

    return ConvNextForImageClassification(ConvNextConfig(num_channels=3, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                                                         image_size=16, num_labels=CLASSES))


def _hf_resnet_fixed():
    """Hugging Face's ResNet with its BatchNorms made GroupNorms by Opacus's ModuleValidator.fix, as users do."""
    from opacus.validators import ModuleValidator
    from transformers import ResNetConfig, ResNetForImageClassification

    model = ResNetForImageClassification(ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                      depths=[1, 1], layer_type="basic", num_labels=CLASSES))
    return ModuleValidator.fix(model)


class Block(nn.Module):
    """A basic residual block with GroupNorm (torchvision's BasicBlock, BatchNorm replaced)."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.GroupNorm(4, cout)
        self.conv2, self.norm2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.GroupNorm(4, cout)
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.GroupNorm(4, cout))

    def forward(self, x):
        h = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(h)) + self.skip(x))


class ResNetGroupNorm(nn.Module):
    """A small ResNet with GroupNorm: a stem, two stages of basic blocks, global pooling, a linear head."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.GroupNorm(4, 8), nn.ReLU())
        self.stages = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.head = nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.head(self.stages(self.stem(x)).mean((2, 3)))


class LSTMClassifier(nn.Module):
    """Embedding, Opacus's DPLSTM, a linear head on the last state."""

    def __init__(self):
        super().__init__()
        from opacus.layers import DPLSTM

        self.embed, self.lstm, self.head = nn.Embedding(VOCAB, 16), DPLSTM(16, 16, batch_first=True), nn.Linear(16, CLASSES)

    def forward(self, x):
        out, _ = self.lstm(self.embed(x))
        return self.head(out[:, -1])


class AttentionClassifier(nn.Module):
    """Embedding, Opacus's DPMultiheadAttention (self-attention), mean over tokens, a linear head."""

    def __init__(self):
        super().__init__()
        from opacus.layers import DPMultiheadAttention

        self.embed, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16, CLASSES)
        self.attention = DPMultiheadAttention(16, 2, batch_first=True)

    def forward(self, x):
        h = self.embed(x)
        out, _ = self.attention(h, h, h)
        return self.head(out.mean(1))


class TupleOutput(nn.Module):
    """Returns (logits, features): the loss uses the first; the second is computed from the same features."""

    def __init__(self):
        super().__init__()
        self.embed, self.body, self.head = nn.Embedding(VOCAB, 16), nn.Linear(16 * TOKENS, 32), nn.Linear(32, CLASSES)

    def forward(self, x):
        features = torch.tanh(self.body(self.embed(x).flatten(1)))
        return self.head(features), features


class DictOutput(TupleOutput):
    """Returns {"logits", "features"}, the features also feeding a second head the loss adds in."""

    def __init__(self):
        super().__init__()
        self.aux = nn.Linear(32, 1)

    def forward(self, x):
        logits, features = super().forward(x)
        return {"logits": logits, "features": features, "score": self.aux(features).squeeze(-1)}


def _plain_loss(model, batch, ce):
    return ce(model(batch[0]), batch[1])


def _dict_loss(model, batch, ce):
    out = model(batch[0])
    return ce(out["logits"] + 0.1 * out["score"][:, None], batch[1])


FAMILIES = {f.name: f for f in [
    Family("gpt2-tied", _gpt2, _tokens, _lm_loss, "transformers"),
    Family("llama-tied", _llama, _tokens, _lm_loss, "transformers"),
    Family("bert", _bert, lambda g: _tokens(g, "classes"), _classifier_loss(), "transformers"),
    Family("t5", _t5, _tokens, _seq2seq_loss, "transformers"),
    Family("lora-gpt2", _lora(_gpt2, ["c_attn"]), _tokens, _lm_loss, "peft"),
    Family("lora-llama", _lora(_llama, ["q_proj", "v_proj"]), _tokens, _lm_loss, "peft"),
    Family("vit", _vit, _images, _classifier_loss("pixel_values"), "transformers"),
    Family("convnext", _convnext, _images, _classifier_loss("pixel_values"), "transformers"),
    Family("hf-resnet-fixed", _hf_resnet_fixed, _images, _classifier_loss("pixel_values"), "transformers"),
    Family("resnet-groupnorm", ResNetGroupNorm, _images, _plain_loss),
    Family("lstm", LSTMClassifier, lambda g: _tokens(g, "classes"), _plain_loss),
    Family("multihead-attention", AttentionClassifier, lambda g: _tokens(g, "classes"), _plain_loss),
    Family("tuple-output", TupleOutput, lambda g: _tokens(g, "classes"), lambda m, b, ce: ce(m(b[0])[0], b[1])),
    Family("dict-output", DictOutput, lambda g: _tokens(g, "classes"), _dict_loss),
]}


@dataclass
class Run:
    params: Optional[torch.Tensor] = None  # the trained parameters, flattened
    error: Optional[str] = None  # what stopped training (first line)
    auditor: object = None


def train(family: Family, mode: str, steps: int, *, audit: Optional[dict] = None, seed: int = 0,
          batch_size: int = 16) -> Run:
    """`steps` steps of DP-SGD with Opacus (Poisson sampling, sigma 1, C 1) in grad_sample_mode `mode`; with `audit`
    (PrivacyAuditor's options) audited as the guides show. Seeds fix the model, the data, the sampling and the noise."""
    from opacus import PrivacyEngine

    torch.manual_seed(seed)
    model = family.build()
    data = family.data(torch.Generator().manual_seed(seed + 1))
    loader = torch.utils.data.DataLoader(data, batch_size=batch_size, generator=torch.Generator().manual_seed(seed + 3))
    ghost = mode == "ghost"
    extra = dict(criterion=nn.CrossEntropyLoss()) if ghost else {}
    run = Run()
    try:
        made = PrivacyEngine().make_private(
            module=model, optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, grad_sample_mode=mode, poisson_sampling=True,
            noise_generator=torch.Generator().manual_seed(seed + 2), **extra)
        private, optimizer, loader = made[0], made[1], made[-1]
        ce = made[2] if ghost else cross_entropy
        step_loss = lambda batch: family.loss(private, batch, ce)  # noqa: E731
        if audit is not None:
            from lightning_dpaudit import PrivacyAuditor

            run.auditor = PrivacyAuditor(optimizer, module=private, data_loader=loader, training_loss=step_loss,
                                         seed=seed, **audit)
        done = 0
        while done < steps:
            for batch in loader:
                optimizer.zero_grad()
                step_loss(batch).backward()
                optimizer.step()
                done += 1
                if done >= steps:
                    break
    except Exception as error:  # Opacus refusing or failing on the model: said, not raised
        run.error = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:200]
    run.params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return run
