"""Tests for lightning_dpaudit.analysis.report: figures, JSON/PNG record, terminal summary."""

import json
import math
import re
import sys

import numpy as np
import pytest
from scipy.stats import norm

from lightning_dpaudit.analysis.report import (
    curves_figure,
    empirical_tradeoff,
    report_figure,
    summary_table,
    tradeoff_figure,
    write_report,
)
from lightning_dpaudit.analysis.report_reading import load_report
from lightning_dpaudit.analysis.results import AuditResult, Finding, LayerAudit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LAYER_NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def fake_result() -> AuditResult:
    layers = tuple(
        LayerAudit(
            name=name,
            mu_lower_bound=1.62 if name == "fc2.weight" else 0.91,
            mu_lower_bound_anytime=1.41 if name == "fc2.weight" else 0.80,
            mu_claimed=1.0,
            n_in=250,
            n_out=250,
            violation=name == "fc2.weight",
        )
        for name in LAYER_NAMES
    )
    return AuditResult(
        epsilon_lower_bound=7.25,
        epsilon_accountant=float("nan"),
        mu_lower_bound=1.234,
        mu_lower_bound_anytime=1.1,
        mu_claimed=1.0,
        violation=True,
        violating_layers=("fc2.weight",),
        n_in=1000,
        n_out=1000,
        steps=50,
        estimator="gdp-cp",
        confidence=0.95,
        delta=1e-5,
        epsilon_step_lower_bound=float("inf"),
        epsilon_step_claimed=4.38,
        first_violation_step=37,
        noise_repeats=0,
        mode="one-run",
        canary="dirac",
        layers=layers,
    )


def observations(s: float, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(1.0, s, n), rng.normal(0.0, s, n)


EDGES = np.concatenate([[-np.inf], np.arange(-1280, 1345) / 64, [np.inf]])  # the observation log's bins
SOURCES = ("raw", "histogram")


def observed(ins, outs, source):
    """Keyword arguments giving the observations as raw values or as the log's fixed-bin histograms."""
    if source == "raw":
        return {"in_values": ins, "out_values": outs}
    return {"histogram": (EDGES, np.histogram(ins, EDGES)[0], np.histogram(outs, EDGES)[0])}


def history():
    return [
        {"step": float(k), "eps_lower_bound": 0.5 * k if k > 1 else float("nan"), "eps_accountant": 1.0 + 0.1 * k}
        for k in range(1, 11)
    ]


def strict_loads(text: str):
    def refuse(name):
        raise ValueError(f"non-strict JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def empirical_line(ax):
    (line,) = [ln for ln in ax.get_lines() if ln.get_label().startswith("empirical")]
    return np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)


def claimed_fnr(fpr, mu):
    return norm.cdf(norm.ppf(1 - np.asarray(fpr)) - mu)


@pytest.mark.parametrize("source", SOURCES)
def test_write_report_creates_strict_json_and_png(tmp_path, source):
    ins, outs = observations(1.0, 2000)
    result = fake_result()
    target = tmp_path / "nested" / "audit"
    json_path, png_path = write_report(
        target,
        result,
        settings={"noise_multiplier": 1.0, "sample_rate": np.float64(0.01), "layers": ("a", "b")},
        versions={"torch": "2.13.0", "lightning_dpaudit": "0.1.0"},
        history=history(),
        **observed(ins, outs, source),
    )
    assert json_path == target / "audit_report.json" and json_path.is_file()
    assert png_path == target / "audit_report.png" and png_path.is_file()

    data = strict_loads(json_path.read_text())
    assert set(data) == {"result", "settings", "versions", "history"}
    r = data["result"]
    assert r["epsilon_accountant"] is None
    assert r["epsilon_step_lower_bound"] == "inf"
    assert r["epsilon_lower_bound"] == pytest.approx(7.25)
    assert r["violating_layers"] == ["fc2.weight"]
    assert [layer["name"] for layer in r["layers"]] == list(LAYER_NAMES)
    assert [layer["violation"] for layer in r["layers"]] == [False, False, True, False]
    assert data["settings"] == {"noise_multiplier": 1.0, "sample_rate": 0.01, "layers": ["a", "b"]}
    assert data["history"][0]["eps_lower_bound"] is None
    assert data["history"][-1] == {"step": 10.0, "eps_lower_bound": 5.0, "eps_accountant": 2.0}

    loaded = load_report(target)
    assert loaded == data
    assert loaded["result"]["first_violation_step"] == 37
    assert loaded["result"]["n_in"] == 1000 and loaded["result"]["steps"] == 50
    assert loaded["versions"]["torch"] == "2.13.0"


@pytest.mark.parametrize("source", SOURCES)
def test_png_is_valid_and_reasonably_sized(tmp_path, source):
    import matplotlib.image as mpimg

    ins, outs = observations(1.0, 2000)
    _, png_path = write_report(
        tmp_path, fake_result(), settings={}, versions={}, history=history(), **observed(ins, outs, source)
    )
    raw = png_path.read_bytes()
    assert raw[:8] == PNG_MAGIC
    assert 10_000 < len(raw) < 2_000_000
    img = mpimg.imread(png_path)
    height, width = img.shape[:2]
    assert 800 <= width <= 2000 and 400 <= height <= 1200
    assert width > height  # two panels side by side


@pytest.mark.parametrize("source", SOURCES)
def test_tradeoff_shows_leak_below_claimed_curve(source):
    ins, outs = observations(0.5, 5000, seed=1)  # true mu 2, claimed mu 1
    fig = tradeoff_figure(**observed(ins, outs, source), mu_claimed=1.0, mu_lower=1.8)
    ax = fig.axes[0]
    fpr, fnr = empirical_line(ax)
    assert len(fpr) <= (2002 if source == "raw" else len(EDGES))
    gap = claimed_fnr(fpr, 1.0) - fnr
    assert gap.max() > 0.1
    labels = [ln.get_label() for ln in ax.get_lines()]
    assert any("claimed" in lab for lab in labels) and any("lower" in lab for lab in labels)
    assert ax.get_title() == "Trade-off: empirical vs claimed"


@pytest.mark.parametrize("source", SOURCES)
def test_tradeoff_matches_claim_for_correct_mechanism(source):
    ins, outs = observations(1.0, 20_000, seed=2)
    fig = tradeoff_figure(**observed(ins, outs, source), mu_claimed=1.0)
    ax = fig.axes[0]
    fpr, fnr = empirical_line(ax)
    assert len(fpr) <= (2002 if source == "raw" else len(EDGES))
    assert np.all(np.diff(fpr) >= 0)
    assert (fpr[0], fnr[0]) == (0.0, 1.0) and (fpr[-1], fnr[-1]) == (1.0, 0.0)
    grid = np.linspace(0.1, 0.9, 81)
    empirical = np.interp(grid, fpr, fnr)
    assert np.max(np.abs(empirical - claimed_fnr(grid, 1.0))) < 0.03
    assert ax.get_xlim() == (0.0, 1.0) and ax.get_ylim() == (0.0, 1.0)
    assert ax.get_aspect() == 1.0
    assert not any("lower" in ln.get_label() for ln in ax.get_lines())


def test_tradeoff_from_histogram_is_the_raw_curve_at_the_bin_edges():
    ins, outs = observations(1.0, 20_000, seed=3)
    fpr, fnr = empirical_line(tradeoff_figure(**observed(ins, outs, "histogram"), mu_claimed=1.0).axes[0])
    raw_fpr, raw_fnr = empirical_tradeoff(ins, outs, thresholds=EDGES)
    # the drawn points are the exact points at the edges, without the repeats empty bins give
    assert 300 < len(fpr) < len(EDGES) and set(zip(fpr, fnr)) == set(zip(raw_fpr, raw_fnr))
    assert np.all(np.diff(fpr) >= 0) and np.all((np.diff(fpr) > 0) | (np.diff(fnr) < 0))
    # between edges the curve stays within the figure's resolution of the raw curve
    every_fpr, every_fnr = empirical_line(tradeoff_figure(ins, outs, mu_claimed=1.0).axes[0])
    assert np.max(np.abs(np.interp(every_fpr, fpr, fnr) - every_fnr)) < 0.01


def test_tradeoff_needs_raw_values_or_a_histogram():
    ins, outs = observations(1.0, 100)
    with pytest.raises(ValueError, match="not both"):
        tradeoff_figure(ins, outs, mu_claimed=1.0, **observed(ins, outs, "histogram"))
    with pytest.raises(ValueError, match="or `histogram`"):
        tradeoff_figure(ins, mu_claimed=1.0)


@pytest.mark.parametrize("source", SOURCES)
def test_tradeoff_draws_on_given_axes(source):
    from matplotlib.figure import Figure

    fig = Figure()
    ax = fig.add_subplot()
    ins, outs = observations(1.0, 500)
    assert tradeoff_figure(**observed(ins, outs, source), mu_claimed=1.0, ax=ax) is fig
    assert any(ln.get_label().startswith("empirical") for ln in ax.get_lines())


def test_curves_and_report_figures():
    fig = curves_figure(history())
    ax = fig.axes[0]
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"empirical lower bound", "accountant"}
    np.testing.assert_allclose(lines["accountant"].get_xdata(), np.arange(1, 11))
    assert math.isnan(lines["empirical lower bound"].get_ydata()[0])
    assert lines["empirical lower bound"].get_ydata()[-1] == 5.0
    assert ax.get_xlabel() == "optimizer step"

    ins, outs = observations(1.0, 500)
    both = report_figure(ins, outs, history(), mu_claimed=1.0, mu_lower=0.9)
    assert len(both.axes) == 2
    assert both.axes[0].get_title().startswith("Trade-off")
    binned = report_figure(history=history(), mu_claimed=1.0, mu_lower=0.9, **observed(ins, outs, "histogram"))
    assert len(binned.axes) == 2 and empirical_line(binned.axes[0])[0][-1] == 1.0


@pytest.mark.parametrize("source", SOURCES)
def test_summary_table_from_loaded_report(tmp_path, source):
    ins, outs = observations(1.0, 500)
    write_report(tmp_path, fake_result(), settings={}, versions={}, history=history(), **observed(ins, outs, source))
    text = summary_table(load_report(tmp_path))
    lines = text.splitlines()
    assert lines[0].startswith("VIOLATION:") and "fc2.weight" in lines[0] and "step 37" in lines[0]
    assert 12 <= len(lines) <= 25
    for name in LAYER_NAMES:
        assert name in text
    for number in ("7.25", "1.234", "1.000", "1000", "1.620", "0.910", "4.38", "gdp-cp", "95%", "1e-05"):
        assert number in text
    assert "n/a" in text  # the nan accountant epsilon
    (fc2,) = [ln for ln in lines if ln.strip().startswith("fc2.weight")]
    assert fc2.rstrip().endswith("VIOLATION")
    (fc1,) = [ln for ln in lines if ln.strip().startswith("fc1.weight")]
    assert "VIOLATION" not in fc1


def test_summary_table_ok_from_result_dict():
    import dataclasses

    ok = dataclasses.replace(
        fake_result(),
        violation=False,
        violating_layers=(),
        first_violation_step=None,
        epsilon_accountant=8.0,
        layers=tuple(dataclasses.replace(layer, violation=False) for layer in fake_result().layers),
    )
    text = summary_table({"result": ok.to_dict()})
    assert text.splitlines()[0] == "OK: no leak beyond the claim detected"
    assert "VIOLATION" not in text and "8.00" in text


LEAK = Finding(
    code="layer",
    message="noise std below the claim in 1 of 4 tensors: fc2.weight 0.5 x claimed (95% CI 0.4-0.6)",
    first_step=37,
    layers=("fc2.weight",),
    measured=0.5,
    claimed=1.0,
)


def test_findings_in_the_json_and_the_summary(tmp_path):
    import dataclasses

    result = dataclasses.replace(fake_result(), findings=(LEAK, Finding(code="general", message="unexplained")))
    write_report(tmp_path, result, settings={}, versions={}, history=history(), **observed(*observations(1.0, 500), "raw"))
    report = strict_loads((tmp_path / "audit_report.json").read_text())
    assert report["result"]["findings"] == [
        {"code": "layer", "message": LEAK.message, "first_step": 37, "layers": ["fc2.weight"], "measured": 0.5, "claimed": 1.0,
         "scope": ""},
        {"code": "general", "message": "unexplained", "first_step": None, "layers": [], "measured": None, "claimed": None,
         "scope": ""},
    ]
    lines = summary_table(load_report(tmp_path)).splitlines()
    assert lines[0].startswith("VIOLATION:")
    assert lines[1:3] == [f"  - layer: {LEAK.message}", "  - general: unexplained"] and lines[3] == ""


def test_summary_of_a_report_written_before_findings(tmp_path):
    write_report(tmp_path, fake_result(), settings={}, versions={}, history=history(), **observed(*observations(1.0, 500), "raw"))
    path = tmp_path / "audit_report.json"
    report = json.loads(path.read_text())
    del report["result"]["findings"]
    path.write_text(json.dumps(report))
    lines = summary_table(load_report(tmp_path)).splitlines()
    assert lines[0].startswith("VIOLATION:") and lines[1] == ""
    assert not any(line.startswith("  - ") for line in lines)


def test_load_report_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="audit_report.json"):
        load_report(tmp_path)


def test_report_module_avoids_torch_and_pyplot():
    import subprocess

    code = (
        "import sys, lightning_dpaudit.analysis.report as r; "
        "import numpy as np; r.tradeoff_figure(np.ones(3), np.zeros(3), mu_claimed=1.0); "
        "r.tradeoff_figure(histogram=([-np.inf, 0.5, np.inf], [0, 3], [3, 0]), mu_claimed=1.0); "
        "assert 'torch' not in sys.modules and 'matplotlib.pyplot' not in sys.modules, sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------------------ reports that contradict themselves


def ok_result() -> AuditResult:
    """fake_result without its violation: no tensor flagged, every anytime bound below its claim."""
    from dataclasses import replace

    layers = tuple(replace(layer, violation=False, mu_lower_bound_anytime=0.8) for layer in fake_result().layers)
    return replace(fake_result(), violation=False, violating_layers=(), first_violation_step=None, layers=layers,
                   mu_lower_bound_anytime=0.9)


def _written(tmp_path, result) -> dict:
    write_report(tmp_path, result, settings={}, versions={}, history=[], in_values=[1.0, 0.9], out_values=[0.0, 0.1])
    return json.loads((tmp_path / "audit_report.json").read_text())


def _set_result(**changes):
    return lambda r: r.update(changes)


_CONTRADICTIONS = [
    # numbers out of range, or NaN
    (ok_result, lambda r: r.update(epsilon_lower_bound=float("nan")), r"`epsilon_lower_bound` is NaN; expected a number"),
    (ok_result, _set_result(mu_lower_bound="nan"), r"`mu_lower_bound` is 'nan'; expected a number"),
    (ok_result, _set_result(delta=5), r"`delta` is 5; it must lie in \(0, 1\)"),
    (ok_result, _set_result(delta=None), r"`delta` is null; expected a number"),
    (ok_result, _set_result(confidence=7), r"`confidence` is 7; it must lie in \(0, 1\)"),
    (ok_result, _set_result(confidence=0), r"`confidence` is 0; it must lie in \(0, 1\)"),
    (ok_result, _set_result(mu_claimed=0), r"`mu_claimed` is 0; it must be > 0"),
    (ok_result, lambda r: r["layers"][1].update(n_in=-4), r"`layers\[1\].n_in` is -4; expected a whole number >= 0"),
    (ok_result, _set_result(noise_repeats=-1), r"`noise_repeats` is -1"),
    # a violation flag that contradicts the numbers
    (fake_result, _set_result(violation=False),
     r"`violation` is false, but `violating_layers` is \['fc2.weight'\]: the verdict contradicts the groups"),
    (fake_result, lambda r: r.update(violation=False, violating_layers=[], first_violation_step=None,
                                     layers=[{**layer, "violation": False} for layer in r["layers"]]),
     r"`violation` is false, but the anytime mu lower bound 1.1 exceeds the claimed 1: the alarm fires when it does"),
    (fake_result, _set_result(first_violation_step=None), r"`violation` is true, but `first_violation_step` is None"),
    (fake_result, lambda r: r["layers"][2].update(violation=False),
     r"`layers` flag tensor 'fc2.weight' not violating but `violating_layers` is \['fc2.weight'\]"),
    (ok_result, _set_result(violation=True),
     r"`violation` is true, but `violating_layers` is \[\]: the verdict contradicts the groups whose alarm fired"),
    (ok_result, lambda r: r.update(violation=True, violating_layers=["pooled"]), r"`first_violation_step` is None"),
    (ok_result, _set_result(noise_repeats=3), r"`violation` is false, but 3 step\(s\) repeated earlier noise"),
]


@pytest.mark.parametrize("make,corrupt,message", _CONTRADICTIONS)
def test_a_report_whose_numbers_contradict_its_verdict_is_refused(tmp_path, capsys, make, corrupt, message):
    from lightning_dpaudit.analysis.report_reading import ReportError
    from lightning_dpaudit.app.cli import VIOLATION_EXIT, main

    report = _written(tmp_path, make())
    assert main(["report", str(tmp_path)]) == (VIOLATION_EXIT if make is fake_result else 0)  # as written: it reads
    capsys.readouterr()
    corrupt(report["result"])
    (tmp_path / "audit_report.json").write_text(json.dumps(report))  # NaN is written as JSON's NaN
    with pytest.raises(ReportError, match=message):
        load_report(tmp_path)
    status = main(["report", str(tmp_path)])
    err = capsys.readouterr()
    assert status == 1 != VIOLATION_EXIT and err.out == ""
    assert len(err.err.strip().splitlines()) == 1 and re.search(message, err.err)


def test_the_report_of_a_real_audit_reads_back():
    """The verdict rules hold for what an audit writes: a short audit's report loads as written."""
    import tempfile
    import warnings
    from pathlib import Path

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

    model, optimizer, loader, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train_steps(model, optimizer, loader, 3)
        result = auditor.result()
    with tempfile.TemporaryDirectory() as directory:
        write_report(directory, result, settings={}, versions={}, history=[], histogram=auditor.log.histogram())
        assert load_report(Path(directory))["result"]["violation"] is False


def test_a_layer_row_above_its_claim_without_an_alarm_says_why_on_its_line():
    import dataclasses

    base = fake_result()
    first = dataclasses.replace(base.layers[0], violation=False, mu_lower_bound=1.036, mu_claimed=1.0,
                                mu_lower_bound_anytime=0.91)
    ok = dataclasses.replace(base, violation=False, violating_layers=(), first_violation_step=None,
                             layers=(first, *(dataclasses.replace(layer, violation=False, mu_lower_bound=0.5)
                                              for layer in base.layers[1:])))
    lines = summary_table({"result": ok.to_dict()}).splitlines()
    row = next(line for line in lines if line.lstrip().startswith(first.name + " "))
    assert "1.036" in row and "above its claim at one look; no alarm: the anytime bound the alarm uses is 0.910" in row
    others = [line for line in lines if any(line.lstrip().startswith(layer.name + " ") for layer in ok.layers[1:])]
    assert others and not any("above its claim" in line for line in others)


def test_an_ok_verdict_says_when_the_exact_checks_compared_nothing():
    import dataclasses

    ok = dataclasses.replace(fake_result(), violation=False, violating_layers=(), first_violation_step=None,
                             data_path="nothing compared yet (no forward pass of the model was seen)",
                             layers=tuple(dataclasses.replace(layer, violation=False) for layer in fake_result().layers))
    assert summary_table({"result": ok.to_dict()}).splitlines()[0] == (
        "OK: no leak beyond the claim detected; the exact checks compared nothing (see below)")
