"""Tests for lightning_dpaudit.analysis.observations: bounded histograms, the recent window, state."""

import io
import pickle

import numpy as np
import pytest
import torch

from lightning_dpaudit.analysis.monitor import POOLED, AnytimeMonitor
from lightning_dpaudit.analysis.observations import COLUMNS, ObservationLog
from lightning_dpaudit.analysis.report import empirical_tradeoff, tradeoff_from_histograms

KINDS = ["dirac", "constant"]


def steps_of(rng, steps, per_step, layers=8, s=1.0):
    """(step, layer, is_in, value) of simulated steps: out ~ N(0, s^2), in ~ N(1, s^2)."""
    for step in range(steps):
        layer = rng.integers(0, layers, per_step)
        is_in = rng.random(per_step) < 0.5
        yield step, layer, is_in, rng.normal(0.0, s, per_step) + is_in


def fill(log, rows, kind="dirac"):
    for step, layer, is_in, value in rows:
        log.append(step=step, layer=layer, kind=kind, is_in=is_in, value=value)


def columns(rows, kind_code=0):
    rows = list(rows)
    return {
        "step": np.concatenate([np.full(len(v), s) for s, _, _, v in rows]),
        "layer": np.concatenate([layer for _, layer, _, _ in rows]),
        "kind": np.concatenate([np.full(len(v), kind_code) for _, _, _, v in rows]),
        "is_in": np.concatenate([i for _, _, i, _ in rows]),
        "value": np.concatenate([v for _, _, _, v in rows]),
    }


def awkward_values(log, rng, n):
    """Values on and next to bin edges, beyond the range, infinite and NaN, mixed with Gaussians."""
    finite = log.edges[1:-1]
    edges = rng.choice(finite, n // 4)
    return np.concatenate([
        edges,
        np.nextafter(edges, -np.inf),
        np.nextafter(edges, np.inf),
        rng.normal(0.5, 8.0, n - 3 * (n // 4) - 6),
        [np.inf, -np.inf, np.nan, -1e300, 1e300, -20.000001],
    ])


def reference_histogram(edges, values):
    """np.histogram of the same values; NaN counts with -inf (no threshold calls it in)."""
    return np.histogram(np.where(np.isnan(values), -np.inf, values), bins=edges)[0]


# ------------------------------------------------------------------ histograms


def test_histogram_counts_equal_numpy_histogram():
    rng = np.random.default_rng(0)
    log = ObservationLog(KINDS, window=100)
    rows = []
    for step in range(40):
        value = awkward_values(log, rng, 128)
        rows.append((step, rng.integers(0, 5, value.size), rng.random(value.size) < 0.5, value))
    fill(log, rows)
    c = columns(rows)
    edges, ins, outs = log.histogram()
    assert edges[0] == -np.inf and edges[-1] == np.inf and len(ins) == len(outs) == len(edges) - 1 == 2626
    assert edges[1] == -20.0 and edges[-2] == 21.0 and {0.0, 0.5, 1.0} <= set(edges)
    np.testing.assert_array_equal(ins, reference_histogram(edges, c["value"][c["is_in"]]))
    np.testing.assert_array_equal(outs, reference_histogram(edges, c["value"][~c["is_in"]]))
    for layer in range(5):
        _, ins, outs = log.histogram(layer)
        here = c["layer"] == layer
        np.testing.assert_array_equal(ins, reference_histogram(edges, c["value"][here & c["is_in"]]))
        np.testing.assert_array_equal(outs, reference_histogram(edges, c["value"][here & ~c["is_in"]]))
    _, ins, outs = log.histogram(7)  # a layer never seen
    assert not ins.any() and not outs.any()
    assert len(log) == log.total == len(c["value"]) and log.dropped == len(c["value"]) - 100


def test_counts_at_the_monitors_threshold_match_the_monitor():
    rng = np.random.default_rng(1)
    log = ObservationLog(KINDS)
    monitor = AnytimeMonitor({i: 1.0 for i in range(4)}, 1.0, confidence=0.95)
    for step, layer, is_in, value in steps_of(rng, 50, 128, layers=4):
        value[:4] = [0.5, np.nextafter(0.5, 0.0), np.nan, np.inf]  # exactly at, just below, NaN, +inf
        log.append(step=step, layer=layer, kind="dirac", is_in=is_in, value=value)
        monitor.update(layer, is_in, value)
    counts = monitor.group_counts()
    for group in (POOLED, 0, 3):
        edges, ins, outs = log.histogram(None if group == POOLED else group)
        at = int(np.flatnonzero(edges == 0.5)[0])
        tp, fn, fp, tn = counts[group]
        assert (ins[at:].sum(), ins[:at].sum(), outs[at:].sum(), outs[:at].sum()) == (tp, fn, fp, tn)


def test_tradeoff_from_histograms_equals_raw_values_at_every_edge():
    rng = np.random.default_rng(2)
    log = ObservationLog(KINDS, window=1000)
    rows = list(steps_of(rng, 60, 128, layers=3, s=1.5))
    rows.append((60, np.zeros(6, int), np.array([1, 0, 1, 0, 1, 0], bool), np.array([0.5, 0.5, 1.0, -30.0, 25.0, 21.0])))
    fill(log, rows)
    c = columns(rows)
    for layer in (None, 0, 2):
        keep = np.ones(len(c["value"]), bool) if layer is None else c["layer"] == layer
        ins, outs = c["value"][keep & c["is_in"]], c["value"][keep & ~c["is_in"]]
        edges, in_counts, out_counts = log.histogram(layer)
        fpr, fnr = tradeoff_from_histograms(edges, in_counts, out_counts)
        raw_fpr, raw_fnr = empirical_tradeoff(ins, outs, thresholds=edges)
        np.testing.assert_array_equal(fpr, raw_fpr)
        np.testing.assert_array_equal(fnr, raw_fnr)
        assert (fpr[0], fnr[0]) == (0.0, 1.0) and (fpr[-1], fnr[-1]) == (1.0, 0.0)
        assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(fnr) <= 0)
        # and by direct counting at one edge: t = 0.5 is at index len(edges) - 1 - k
        k = int(np.flatnonzero(edges == 0.5)[0])
        i = len(edges) - 1 - k
        assert fpr[i] == np.mean(outs >= 0.5) and fnr[i] == np.mean(ins < 0.5)


def test_tradeoff_from_histograms_refuses_mismatched_counts():
    edges = np.array([-np.inf, 0.0, 1.0, np.inf])
    with pytest.raises(ValueError, match="4 edges make 3 bins, got 2 in-counts"):
        tradeoff_from_histograms(edges, [1, 1], [1, 1, 1])
    with pytest.raises(ValueError, match="at least one in- and one out-observation"):
        tradeoff_from_histograms(edges, [0, 0, 0], [1, 1, 1])


# ------------------------------------------------------------------ the window


def test_window_keeps_exactly_the_last_rows_in_append_order():
    rng = np.random.default_rng(3)
    log = ObservationLog(KINDS, window=1000)
    rows, kinds = [], []
    sizes = [0, 7, 300, 693, 1, 999, 1000, 1500, 13, 250, 250, 250, 2, 600]
    for step, n in enumerate(sizes):
        row = (step, rng.integers(0, 8, n), rng.random(n) < 0.5, rng.normal(size=n))
        kind = KINDS[step % 2]
        log.append(step=row[0], layer=row[1], kind=kind, is_in=row[2], value=row[3])
        rows.append(row)
        kinds.extend([kind] * n)
        every = columns(rows)
        every["kind"] = np.array(kinds, dtype=object)
        got = log.arrays()
        assert set(got) == set(COLUMNS)
        for column in COLUMNS:
            np.testing.assert_array_equal(got[column], every[column][-1000:], err_msg=f"{column} after step {step}")
        assert len(log) == len(every["value"]) and log.dropped == max(len(every["value"]) - 1000, 0)
    ins, outs = log.scores()
    np.testing.assert_array_equal(ins, got["value"][got["is_in"]])
    np.testing.assert_array_equal(outs, got["value"][~got["is_in"]])
    ins, _ = log.scores(layer=3, first_steps=13)
    np.testing.assert_array_equal(ins, got["value"][got["is_in"] & (got["layer"] == 3) & (got["step"] < 13)])


def test_append_refuses_bad_rows():
    log = ObservationLog(KINDS)
    with pytest.raises(ValueError, match="must have one length"):
        log.append(step=0, layer=[0, 1], kind="dirac", is_in=[True], value=[0.1, 0.2])
    with pytest.raises(ValueError, match="layer indices must be >= 0"):
        log.append(step=0, layer=[0, -1], kind="dirac", is_in=[True, False], value=[0.1, 0.2])
    with pytest.raises(ValueError, match="unknown canary kind 'laser'"):
        log.append(step=0, layer=[0], kind="laser", is_in=[True], value=[0.1])
    with pytest.raises(ValueError, match="`window`"):
        ObservationLog(KINDS, window=0)
    assert len(log) == 0 and not log.histogram()[1].any()


# ------------------------------------------------------------------ state


def _sizes(state):
    """Bytes of the state pickled, and saved with torch.save as a Lightning checkpoint holds it."""
    from lightning_dpaudit.integrations.logged_values import _to_checkpoint

    buffer = io.BytesIO()
    torch.save(_to_checkpoint(state), buffer)
    return len(pickle.dumps(state)), len(buffer.getvalue())


def test_state_size_does_not_grow_with_the_run():
    rng = np.random.default_rng(4)
    log = ObservationLog(KINDS)  # default window: 65,536 rows
    fill(log, steps_of(rng, 600, 128))
    short = _sizes(log.state_dict())
    fill(log, ((600 + s, layer, i, v) for s, layer, i, v in steps_of(rng, 1800, 128)))
    long = _sizes(log.state_dict())
    assert len(log) == 2400 * 128
    for a, b in zip(short, long):
        assert abs(b - a) < 0.01 * a, (short, long)
        # 65,536 rows of 23 bytes and 2,626 x 8 x 2 counts of 8 bytes, plus a little framing
        assert b < 65_536 * 23 + 2626 * 8 * 2 * 8 + 10_000
    assert long[0] < 2400 * 128 * 23 / 3  # the earlier format kept every row, 23 bytes each


def test_state_round_trip_continues_identically():
    rng = np.random.default_rng(5)
    rows = list(steps_of(rng, 40, 128))
    log = ObservationLog(KINDS, window=1000)
    fill(log, rows[:25])
    state = pickle.loads(pickle.dumps(log.state_dict()))
    twin = ObservationLog(KINDS, window=1000)
    twin.load_state_dict(state)
    for other in (log, twin):
        fill(other, rows[25:], kind="constant")
    assert len(twin) == len(log) == 40 * 128
    for layer in (None, 0, 7):
        for mine, theirs in zip(log.histogram(layer), twin.histogram(layer)):
            np.testing.assert_array_equal(mine, theirs)
    a, b = log.arrays(), twin.arrays()
    for column in COLUMNS:
        np.testing.assert_array_equal(a[column], b[column])
    assert list(a["kind"][-1:]) == ["constant"] and log.dropped == twin.dropped == 40 * 128 - 1000


def test_earlier_format_state_loads():
    rng = np.random.default_rng(6)
    rows = list(steps_of(rng, 200, 128, layers=5))
    c = columns(rows, kind_code=1)
    earlier = {  # what the earlier ObservationLog.state_dict() saved: every row
        "kinds": list(KINDS),
        "step": c["step"].astype(np.int64),
        "layer": c["layer"].astype(np.int32),
        "kind": c["kind"].astype(np.int16),
        "is_in": c["is_in"].astype(bool),
        "value": c["value"].astype(np.float64),
    }
    log = ObservationLog(KINDS, window=10_000)
    log.load_state_dict(earlier)
    assert len(log) == 200 * 128 and log.dropped == 200 * 128 - 10_000
    edges, ins, outs = log.histogram()
    np.testing.assert_array_equal(ins, reference_histogram(edges, c["value"][c["is_in"]]))
    np.testing.assert_array_equal(outs, reference_histogram(edges, c["value"][~c["is_in"]]))
    _, ins, _ = log.histogram(4)
    np.testing.assert_array_equal(ins, reference_histogram(edges, c["value"][c["is_in"] & (c["layer"] == 4)]))
    got = log.arrays()
    for column in ("step", "layer", "is_in", "value"):
        np.testing.assert_array_equal(got[column], c[column][-10_000:])
    assert set(got["kind"]) == {"constant"}
    # a short earlier-format state fits the window whole, and appending continues after it
    small = ObservationLog(KINDS)
    small.load_state_dict({k: v[:300] if k != "kinds" else v for k, v in earlier.items()})
    small.append(step=200, layer=[1], kind="dirac", is_in=[True], value=[0.25])
    got = small.arrays()
    np.testing.assert_array_equal(got["value"], np.append(c["value"][:300], 0.25))
    assert len(small) == 301 and small.histogram(1)[1].sum() == (c["is_in"][:300] & (c["layer"][:300] == 1)).sum() + 1


def reference_moments(c, layers):
    """(layers, 2, 3) count, sum and sum of squares of the finite values, by numpy on the rows."""
    out = np.zeros((layers, 2, 3))
    for layer in range(layers):
        for side in (0, 1):
            v = c["value"][(c["layer"] == layer) & (c["is_in"] == bool(side)) & np.isfinite(c["value"])]
            out[layer, side] = len(v), v.sum(), (v**2).sum()
    return out


def test_moments_are_exact_and_survive_a_round_trip():
    rng = np.random.default_rng(7)
    rows = list(steps_of(rng, 30, 128, layers=4, s=2.0))
    rows[3][3][:3] = [np.nan, np.inf, -np.inf]  # not finite: left out of the moments
    log = ObservationLog(KINDS, window=100)
    fill(log, rows[:20])
    twin = ObservationLog(KINDS, window=100)
    twin.load_state_dict(pickle.loads(pickle.dumps(log.state_dict())))
    for other in (log, twin):
        fill(other, rows[20:])
    expected = reference_moments(columns(rows), 4)
    assert expected[:, :, 0].sum() == 30 * 128 - 3
    np.testing.assert_allclose(log.moments(), expected, rtol=1e-12)
    np.testing.assert_array_equal(twin.moments(), log.moments())


def test_state_without_moments_gets_them_from_the_histograms():
    rng = np.random.default_rng(8)
    rows = list(steps_of(rng, 100, 128, layers=3, s=1.5))
    log = ObservationLog(KINDS, window=50)
    fill(log, rows)
    state = log.state_dict()
    del state["moments"]  # saved before the log kept moments
    older = ObservationLog(KINDS, window=50)
    older.load_state_dict(state)
    exact, binned = log.moments(), older.moments()
    np.testing.assert_array_equal(binned[:, :, 0], exact[:, :, 0])
    mean = lambda m: m[:, :, 1] / m[:, :, 0]  # noqa: E731
    var = lambda m: m[:, :, 2] / m[:, :, 0] - mean(m) ** 2  # noqa: E731
    # the midpoint of a 1/64-wide bin is within 1/128 of each value
    assert np.max(np.abs(mean(binned) - mean(exact))) < 1 / 128
    np.testing.assert_allclose(var(binned), var(exact), rtol=2e-3)
    # an earlier-format state (every row) gets exact moments from its rows
    rowwise = ObservationLog(KINDS)
    rowwise.load_state_dict({**columns(rows), "kinds": list(KINDS)})
    np.testing.assert_allclose(rowwise.moments(), exact, rtol=1e-12)


def test_tensorboard_histogram_is_the_logs_bins():
    from lightning_dpaudit.integrations.logged_values import _add_histogram

    class Writer:
        def add_histogram_raw(self, tag, **fields):
            self.tag, self.fields = tag, fields

    rng = np.random.default_rng(7)
    log = ObservationLog(KINDS)
    values = np.concatenate([rng.normal(0.0, 1.0, 5000), [-40.0, 30.0]])
    log.append(step=0, layer=np.zeros(values.size, int), kind="dirac", is_in=np.zeros(values.size, bool), value=values)
    edges, _, outs = log.histogram()
    writer = Writer()
    _add_histogram(writer, "out", edges, outs, 3)
    f = writer.fields
    assert writer.tag == "out" and f["global_step"] == 3 and f["num"] == 5002
    assert len(f["bucket_limits"]) == len(f["bucket_counts"]) == 2626  # from the underflow to the overflow bin
    assert sum(f["bucket_counts"]) == 5002 and f["bucket_counts"][0] == 1 and f["bucket_counts"][-1] == 1
    assert f["bucket_limits"][0] == -20.0 and f["bucket_limits"][-1] == 21.0 + 1 / 64
    assert np.all(np.diff(f["bucket_limits"]) > 0) and f["min"] == -20.0 - 1 / 64
    assert abs(f["sum"] / 5002) < 0.05 and abs(f["sum_squares"] / 5002 - 1.0) < 0.5
    inner = ObservationLog(KINDS)
    inner.append(step=0, layer=[0, 0], kind="dirac", is_in=[False, False], value=[0.01, 0.2])
    _add_histogram(writer, "few", *inner.histogram()[::2], 0)
    assert writer.fields["bucket_counts"][0] == 1 and writer.fields["bucket_counts"][-1] == 1
    assert writer.fields["bucket_limits"][0] == 1 / 64 and writer.fields["bucket_limits"][-1] == 13 / 64
