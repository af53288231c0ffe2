"""Construction of input-space canaries (injection into the audit is not built yet)."""

import pytest
import torch

from lightning_dpaudit.digits import DigitsCNN, digits_dataset
from lightning_dpaudit.input_canaries import gradient_cosine, make_input_canary, mean_gradient


@pytest.fixture(scope="module")
def setting():
    torch.manual_seed(0)
    data = digits_dataset()
    inputs, labels = data.tensors[0][:256], data.tensors[1][:256]
    return DigitsCNN(), inputs, labels


def test_blank_and_mislabeled(setting):
    model, inputs, labels = setting
    g = torch.Generator().manual_seed(1)
    x, y = make_input_canary("blank", model, inputs, labels, num_classes=10, generator=g)
    assert x.shape == inputs[0].shape and torch.count_nonzero(x) == 0 and 0 <= int(y) < 10
    g = torch.Generator().manual_seed(2)
    x, y = make_input_canary("mislabeled", model, inputs, labels, num_classes=10, generator=g)
    original = [i for i in range(len(inputs)) if torch.equal(inputs[i], x)]
    assert original and all(int(labels[i]) != int(y) for i in original)


def test_adversarial_raises_its_loss_within_the_ball(setting):
    model, inputs, labels = setting
    g = torch.Generator().manual_seed(3)
    x, y = make_input_canary("adversarial", model, inputs, labels, num_classes=10, steps=10, generator=g)
    source = torch.Generator().manual_seed(3)
    pick = int(torch.randint(len(inputs), (1,), generator=source))
    loss = torch.nn.CrossEntropyLoss()
    assert torch.max(torch.abs(x - inputs[pick])) <= 0.3 + 1e-6
    assert loss(model(x[None]), y[None]) > loss(model(inputs[pick : pick + 1]), labels[pick : pick + 1])


def test_crafted_canary_is_nearly_orthogonal_to_the_mean_gradient(setting):
    model, inputs, labels = setting
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    reference = mean_gradient(model, loss_fn, inputs, labels)
    g = torch.Generator().manual_seed(4)
    x, y = make_input_canary("crafted", model, inputs, labels, num_classes=10, steps=60, generator=g)
    source = torch.Generator().manual_seed(4)
    pick = int(torch.randint(len(inputs), (1,), generator=source))
    before = abs(gradient_cosine(model, loss_fn, inputs[pick : pick + 1], labels[pick : pick + 1], reference))
    after = abs(gradient_cosine(model, loss_fn, x[None], y[None], reference))
    assert after < 0.5 * before, (before, after)


def test_bad_input_is_refused(setting):
    model, inputs, labels = setting
    with pytest.raises(ValueError, match="input canary kinds are mislabeled, blank, adversarial, crafted"):
        make_input_canary("golden", model, inputs, labels, num_classes=10)
    with pytest.raises(ValueError, match="sample of in-distribution inputs"):
        make_input_canary("crafted", model, inputs[:0], labels[:0], num_classes=10)
    with pytest.raises(ValueError, match="integers in \\[0, 10\\)"):
        make_input_canary("blank", model, inputs, labels + 10, num_classes=10)
    with pytest.raises(ValueError, match="has 256 examples but `labels` has 3"):
        make_input_canary("blank", model, inputs, labels[:3], num_classes=10)
