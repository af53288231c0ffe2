"""Input-space canaries: construction of each kind, injection through Opacus's own machinery, errors."""

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from lightning_dpaudit import PrivacyAuditor
from lightning_dpaudit.engine.canaries import input_probe
from lightning_dpaudit.bugs import inject_bug
from lightning_dpaudit.integrations.digits import DigitsCNN, digits_holdout, make_private_digits, train_steps
from lightning_dpaudit.engine.canaries.input_canaries import InputCanaries, craft, make_input_canaries, mean_gradient, per_example_gradients
from lightning_dpaudit.engine.canaries.input_probe import InputProbe, pivoted_cholesky, symmetric_decorrelation
from lightning_dpaudit.testing import train_audited

warnings.filterwarnings("ignore", message=".*Full backward hook.*")
KINDS = ["mislabeled", "blank", "adversarial", "crafted"]


@pytest.fixture(scope="module")
def sample():
    torch.manual_seed(0)
    inputs, labels = digits_holdout(256)
    return DigitsCNN(), inputs, labels


def _build(kind, model, inputs, labels, seed, **options):
    g = torch.Generator().manual_seed(seed)
    return make_input_canaries(kind, model, inputs, labels, count=16, num_classes=10, generator=g, **options)


# ------------------------------------------------------------------ construction


def test_blank_and_mislabeled(sample):
    model, inputs, labels = sample
    x, y = _build("blank", model, inputs, labels, 1)
    assert x.shape == (16, *inputs.shape[1:]) and torch.count_nonzero(x) == 0
    assert set(y.tolist()) == set(range(10))  # labels cycle through the classes
    x, y = _build("mislabeled", model, inputs, labels, 2)
    for xi, yi in zip(x, y):
        sources = [i for i in range(len(inputs)) if torch.equal(inputs[i], xi)]
        assert sources and all(int(labels[i]) != int(yi) for i in sources)


def test_adversarial_raises_each_loss_within_the_ball(sample):
    model, inputs, labels = sample
    x, y = _build("adversarial", model, inputs, labels, 3, steps=10)
    clean, _ = _build("mislabeled", model, inputs, labels, 3)  # same draw of source examples
    loss = torch.nn.CrossEntropyLoss(reduction="none")
    assert torch.max(torch.abs(x - clean)) <= 0.3 + 1e-6
    with torch.no_grad():
        assert torch.all(loss(model(x), y) > loss(model(clean), y))


def test_crafted_canaries_reduce_the_cosine_with_the_mean_gradient(sample):
    model, inputs, labels = sample
    loss_fn = torch.nn.CrossEntropyLoss(reduction="sum")
    reference = mean_gradient(model, loss_fn, inputs, labels)
    x, y = _build("crafted", model, inputs, labels, 4, steps=60)
    start, _ = _build("mislabeled", model, inputs, labels, 4)  # the same held-out examples and labels, before crafting
    alone = craft(model, loss_fn, start, y, reference, steps=60, step_size=0.2, spread=0.0)  # Algorithm 3 only

    def gradients(points):
        return per_example_gradients(model, loss_fn, points, y)

    def mean_abs_cosine(points):
        return float(torch.nn.functional.cosine_similarity(gradients(points), reference[None], dim=1).abs().mean())

    def log_det(points):  # 0 exactly when the canaries' gradients are mutually orthogonal
        unit = torch.nn.functional.normalize(gradients(points), dim=1)
        return float(torch.linalg.slogdet(unit @ unit.T)[1])

    before = mean_abs_cosine(start)
    assert mean_abs_cosine(alone) < 0.5 * before, (before, mean_abs_cosine(alone))
    assert mean_abs_cosine(x) < 0.6 * before, (before, mean_abs_cosine(x))  # while also spreading them apart:
    assert log_det(x) > log_det(start) + 1.0, (log_det(start), log_det(x))


def test_pivoted_cholesky_orders_by_residual_and_factors_the_gram_matrix():
    rng = np.random.default_rng(0)
    d = rng.standard_normal((5, 40))
    d[3] = d[1]  # a duplicate: nothing of its own, so it is taken last with a zero diagonal
    gram = d @ d.T
    chol, order = pivoted_cholesky(gram)
    assert np.allclose(chol @ chol.T, gram[np.ix_(order, order)], atol=1e-9)
    assert order[-1] in (1, 3) and abs(chol[-1, -1]) < 1e-6
    assert np.diag(chol)[0] == pytest.approx(np.sqrt(np.max(np.diag(gram))))


def _probe_on(gradients, min_strength=0.9):
    """An InputProbe for one flat parameter tensor, prepared with these per-sample gradients."""
    param = torch.zeros(gradients.shape[1], dtype=torch.float64)
    probe = InputProbe([param], None, SimpleNamespace(min_strength=min_strength), np.array([1.0]),
                       per_layer=False, max_grad_norm=1.0, loss_reduction="sum", pool=torch.arange(4))
    return probe, probe.prepare([gradients])


def test_observations_decorrelate_exactly_and_keep_more_strength_than_cholesky():
    rng = np.random.default_rng(1)
    base = rng.standard_normal((8, 60))
    g = base + 0.25 * base[[1, 2, 3, 4, 5, 6, 7, 0]]  # overlapping directions
    g[5] = g[2] + 0.01 * rng.standard_normal(60)  # a near-duplicate: not both can be observed
    g = torch.as_tensor(3.0 * g / np.linalg.norm(g, axis=1, keepdims=True))  # norm 3C: clipped to C
    probe, strength = _probe_on(g)
    directions = probe._factors[:, :1] * g.numpy()  # the clipped gradients, norm C
    observed = np.flatnonzero(strength)
    assert not {2, 5} <= set(observed) and len(observed) >= 5
    assert np.all(strength[observed] >= 0.9) and np.all(strength[observed] <= 1.0 + 1e-12)
    cholesky = np.diag(pivoted_cholesky(directions[observed] @ directions[observed].T)[0])
    assert strength[observed].sum() > cholesky.sum()  # the symmetric root has the largest trace
    # Without noise every observation is its canary's in/out bit exactly, whatever the others do.
    b = np.array([1, 0, 1, 1, 0, 1, 0, 1], dtype=bool)
    idx, values = probe.project([torch.as_tensor(directions.T @ b)], [torch.zeros(60, dtype=torch.float64)], b)
    assert np.array_equal(idx, observed) and np.allclose(values, b[observed], atol=1e-9)
    # Noise z ~ N(0, I) reaches the observations as M z with M M^T = diag(1 / strength^2):
    # independent, each with the variance of its strength (columns of M from unit noise).
    zero = [torch.zeros(60, dtype=torch.float64)]
    m = np.stack([probe.project([torch.as_tensor(e)], zero, np.zeros(8, bool))[1] for e in np.eye(60)], axis=1)
    assert np.allclose(m @ m.T, np.diag(1.0 / strength[observed] ** 2), atol=1e-9)


def test_rows_move_in_place_and_values_are_gathered_tensor_by_tensor(monkeypatch):
    monkeypatch.setattr(input_probe, "CHUNK", 18)  # 3 columns a chunk over 6 rows
    rng = np.random.default_rng(2)
    params = [torch.zeros(3, 4), torch.zeros(5), torch.zeros(2, 2, 2)]
    pool = torch.as_tensor([20, 0, 13, 12, 5, 24])
    probe = InputProbe(params, None, SimpleNamespace(min_strength=0.1), np.ones(3), per_layer=False,
                       max_grad_norm=1.0, loss_reduction="sum", pool=pool)
    grads = [torch.as_tensor(rng.standard_normal((6, *p.shape)), dtype=torch.float32) for p in params]
    original = [g.clone() for g in grads]
    probe.prepare(grads)
    released = [torch.as_tensor(rng.standard_normal(p.shape), dtype=torch.float32) for p in params]
    zero = [torch.zeros_like(p) for p in params]
    is_in, predicted = np.array([0, 1, 1, 0, 1, 0], dtype=bool), rng.standard_normal(len(pool))
    observed, before = probe.project(released, zero, is_in, predicted)
    assert len(observed) > 1
    for which in (is_in, ~is_in, np.ones(6, bool), is_in):
        rows = probe.canary_rows(which)
        for row, g, held in zip(rows, original, grads):
            assert torch.equal(row, g[np.flatnonzero(which)]) and row.data_ptr() == held.data_ptr()  # views
        again = probe.project(released, zero, is_in, predicted)  # the rows' order does not matter
        assert np.array_equal(again[0], observed) and np.allclose(again[1], before, rtol=1e-12)
    whole = torch.cat([t.reshape(-1) for t in released]).double().numpy()
    assert np.array_equal(probe.at_pool(released), whole[pool.numpy()])
    assert np.array_equal(probe.gather(released, [24, 3, 12, 11]), whole[[24, 3, 12, 11]])


def _flat_reference(grads, probe, released, data_sum, added, is_in, predicted):
    """Observations the direct way: the (k, P) float64 directions, whole-model float64 vectors.

    Returns (observed, values, noise at the pool).
    """
    k = grads[0].shape[0]
    flat = [g.reshape(k, -1).double() for g in grads]
    norms = torch.stack([f.norm(dim=1) for f in flat], dim=1)
    if probe.per_layer:
        factors = (torch.as_tensor(probe.clip_bounds)[None, :] / (norms + 1e-6)).clamp(max=1.0)
    else:
        total = norms.norm(dim=1, keepdim=True)
        factors = (probe.max_grad_norm / (total + 1e-6)).clamp(max=1.0).expand_as(norms)
    directions = torch.cat([f * factors[:, i : i + 1] for i, f in enumerate(flat)], dim=1)
    gram = (directions @ directions.T).numpy()
    observed, root, root_inverse = symmetric_decorrelation(gram, probe.canaries.min_strength * probe.max_grad_norm)

    def whole(tensors):
        return torch.cat([t.detach().reshape(-1).double() for t in tensors])

    difference = whole(released) - whole(data_sum)
    noise = difference if added is None else difference - whole(added)
    difference = difference.clone()
    difference[probe.pool] -= torch.as_tensor(predicted)
    b = np.asarray(is_in, dtype=float)
    hidden = np.ones(k, dtype=bool)
    hidden[observed] = False
    along = (directions @ difference).numpy()[observed] - gram[np.ix_(observed, hidden)] @ b[hidden]
    diag = np.diag(root)
    values = (root_inverse @ along - root @ b[observed] + diag * b[observed]) / diag
    return observed, values, noise[probe.pool].numpy()


@pytest.mark.parametrize("clipping, mode, chunk", [
    ("flat", "one-run", None), ("flat", "one-run", 777), ("per_layer", "paired", 1000), ("per_layer", "one-run", 5000),
])
def test_observations_match_the_flat_float64_computation(clipping, mode, chunk, monkeypatch):
    """Tensor by tensor and chunk by chunk, the observations are those of the whole-model float64 algorithm."""
    if chunk is not None:
        monkeypatch.setattr(input_probe, "CHUNK", chunk)  # chunks end inside tensors and rows
    inputs, labels = digits_holdout(64)
    model, opt, loader, _ = make_private_digits(holdout=64, clipping=clipping)
    canaries = InputCanaries("mislabeled", inputs=inputs, labels=labels, min_strength=0.3)  # many observed
    auditor = PrivacyAuditor(opt, canary=canaries, module=model, canaries_per_step=16, mode=mode, seed=3)
    probe, rng = auditor.kind.input_probe, np.random.default_rng(0)
    seen = {"grads": None, "calls": 0, "observed": 0}
    prepare, project, read = probe.prepare, probe.project, auditor.kind.read

    def record_prepare(grads):
        seen["grads"] = [g.clone() for g in grads]  # by canary, before canary_rows moves rows
        return prepare(grads)

    def checked_read(planted, view):
        released, data_sum, is_in = view.released, view.data, view.is_in
        sums = None if view.canary_sum is None else view.canary_sum.values  # the canaries' clipped sum, per tensor
        reference = _flat_reference(seen["grads"], probe, released, data_sum, sums, is_in, np.zeros(len(probe.pool)))
        noise = probe.at_pool(released) - probe.at_pool(data_sum) - (0.0 if sums is None else probe.at_pool(sums))
        assert np.array_equal(noise, reference[2])  # gathered per tensor: the same float64 arithmetic
        predicted = rng.standard_normal(len(probe.pool))  # the prediction's path, with an arbitrary prediction
        observed, values = project(released, data_sum, is_in, predicted)
        expected = _flat_reference(seen["grads"], probe, released, data_sum, sums, is_in, predicted)
        assert np.array_equal(observed, expected[0])
        np.testing.assert_allclose(values, expected[1], rtol=1e-6, atol=1e-9)
        captured = {}
        probe.project = lambda *a: captured.setdefault("out", project(*a))
        reading = read(planted, view)  # the auditor's own reading (no noise repeats: no prediction)
        assert np.array_equal(captured["out"][0], reference[0])
        np.testing.assert_allclose(captured["out"][1], reference[1], rtol=1e-6, atol=1e-9)
        seen["calls"] += 1
        seen["observed"] += len(reference[0])
        return reading

    probe.prepare, auditor.kind.read = record_prepare, checked_read
    train_steps(model, opt, loader, 4)
    assert seen["calls"] == (8 if mode == "paired" else 4) and seen["observed"] > 0
    assert probe._grads == []  # the gradients are not kept past the step


# ------------------------------------------------------------------ injection


def _params(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("kind", KINDS)
def test_injection_leaves_the_update_unchanged(kind):
    inputs, labels = digits_holdout(64)
    runs = {}
    for audited in (False, True):
        torch.manual_seed(11)
        model, opt, loader, _ = make_private_digits(noise_multiplier=1.0, seed=5, holdout=64)
        if audited:
            auditor = PrivacyAuditor(
                opt, canary=kind, module=model, canary_inputs=inputs, canary_labels=labels,
                canaries_per_step=8, recraft_every=5, seed=0,
            )
            auditor.options.canary.options["steps"] = 3  # a few crafting steps are enough here
        train_steps(model, opt, loader, 12)
        runs[audited] = (_params(model), opt.generator.get_state(), torch.get_rng_state())
    assert torch.max(torch.abs(runs[False][0] - runs[True][0])).item() <= 1e-6
    assert torch.equal(runs[False][1], runs[True][1]), "the optimizer's noise stream was touched"
    assert torch.equal(runs[False][2], runs[True][2]), "the auditor drew from torch's global generator"
    result = auditor.result()
    assert result.canary == kind and result.n_in > 0 and result.n_out > 0 and not result.violation
    if kind in ("adversarial", "crafted"):
        assert auditor.options.canary.builds == 3  # steps 0, 5 and 10


def test_observations_are_unit_shifted_gaussians_with_noise_at_least_sigma():
    # 200 steps x 32 canaries; only canaries keeping >= 0.9 of their own direction are observed.
    result, obs = train_audited(steps=200, canary="mislabeled", canaries_per_step=32, return_observations=True)
    ins, outs = obs["value"][obs["is_in"]], obs["value"][~obs["is_in"]]
    assert len(ins) > 300 and len(outs) > 300
    # out ~ N(0, s^2), in ~ N(1, s^2) with s >= sigma = 1: the means lie within 5 standard errors
    # (false failure < 1e-5), the spread is at least sigma.
    assert abs(outs.mean()) < 5 * outs.std() / np.sqrt(len(outs))
    assert abs(ins.mean() - 1.0) < 5 * ins.std() / np.sqrt(len(ins))
    assert outs.std() > 0.95 and not result.violation
    assert set(obs["layer"]) == {0} and result.layers[0].name == "all parameters"


def test_paired_mode_and_the_observation_window():
    result, obs = train_audited(steps=30, canary="blank", mode="paired", canaries_per_step=10, return_observations=True)
    assert result.n_in == result.n_out > 0 and not result.violation
    windowed, obs = train_audited(steps=30, canary="blank", canaries_per_step=10, observe_steps=12, return_observations=True)
    assert windowed.steps == 30 and obs["step"].max() == 11


@pytest.mark.parametrize("bug", ["no-noise", "reused-noise"])
def test_input_canaries_catch_bugs(bug):
    result = train_audited(steps=150, canary="mislabeled", canaries_per_step=16, stop_on_violation=True,
                           transform=lambda o: inject_bug(o, bug))
    assert result.violation, result


def test_state_round_trip_keeps_the_canaries():
    inputs, labels = digits_holdout(64)
    model, opt, loader, _ = make_private_digits(holdout=64)
    auditor = PrivacyAuditor(opt, canary="mislabeled", module=model, canary_inputs=inputs, canary_labels=labels,
                             canaries_per_step=8, seed=1)
    train_steps(model, opt, loader, 3)
    state = auditor.state_dict()
    auditor.detach()
    again = PrivacyAuditor(opt, canary="mislabeled", module=model, canary_inputs=inputs, canary_labels=labels,
                           canaries_per_step=8, seed=2)
    again.load_state_dict(state)
    assert torch.equal(again.options.canary.x, auditor.options.canary.x) and torch.equal(again.options.canary.y, auditor.options.canary.y)
    assert again.steps == 3 and again.result().n_in == auditor.result().n_in


# ------------------------------------------------------------------ errors at attach time


def test_bad_input_is_refused_at_attach_time():
    inputs, labels = digits_holdout(64)
    model, opt, _, _ = make_private_digits(holdout=64)

    def attach(**options):
        merged = {"canary": "crafted", "module": model, "canary_inputs": inputs, "canary_labels": labels, **options}
        return PrivacyAuditor(opt, **merged)

    with pytest.raises(ValueError, match="need a sample of in-distribution inputs"):
        attach(canary_inputs=None)
    with pytest.raises(ValueError, match="cannot take canary inputs of shape \\(1, 4, 4\\)"):
        attach(canary_inputs=inputs[:, :, :4, :4])
    with pytest.raises(ValueError, match="model's dtype torch.float32; got torch.float64"):
        attach(canary_inputs=inputs.double())
    with pytest.raises(ValueError, match="integers in \\[0, 10\\)"):
        attach(canary_labels=labels + 10)
    with pytest.raises(ValueError, match="has 64 examples but `labels` has 3"):
        attach(canary_labels=labels[:3])
    with pytest.raises(TypeError, match="not an Opacus GradSampleModule"):
        attach(module=DigitsCNN())
    with pytest.raises(ValueError, match="need the model: pass `module=`"):
        attach(module=None)
    with pytest.raises(ValueError, match="input canary kinds are mislabeled, blank, adversarial, crafted"):
        InputCanaries("golden", inputs=inputs, labels=labels)
    with pytest.raises(ValueError, match="`recraft_every`: 0"):
        attach(recraft_every=0)
    with pytest.raises(ValueError, match="`observe_steps`: 0"):
        attach(observe_steps=0)
