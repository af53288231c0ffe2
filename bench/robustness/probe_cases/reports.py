"""Probe cases: audit_report.json read by `dpaudit report`, and the CLI's commands."""

from __future__ import annotations

import json
import os
import tempfile
import warnings

from .common import Case, HANDLED, INF, NAN, REFUSED, describe, quiet


GOOD_RESULT = {
    "violation": False, "violating_layers": [], "steps": 10, "n_in": 5, "n_out": 5, "epsilon_lower_bound": 0.5,
    "epsilon_accountant": 1.0, "mu_lower_bound": 0.3, "mu_claimed": 1.0, "delta": 1e-5, "confidence": 0.95,
    "first_violation_step": None,
}


def report_cases():
    damaged = [
        ("empty", "", 1), ("whitespace", "   \n", 1), ("null", "null", 1), ("number", "42", 1), ("string", '"x"', 1),
        ("result=null", json.dumps({"result": None}), 1), ("result=list", json.dumps({"result": [1]}), 1),
        ("NaN epsilon", json.dumps({"result": {**GOOD_RESULT, "epsilon_lower_bound": NAN}}), 1),
        ("Infinity mu", json.dumps({"result": {**GOOD_RESULT, "mu_lower_bound": INF}}), 1),
        ("steps=-1", json.dumps({"result": {**GOOD_RESULT, "steps": -1}}), 1),
        ("steps=1e30", json.dumps({"result": {**GOOD_RESULT, "steps": 1e30}}), 1),
        ("steps=true", json.dumps({"result": {**GOOD_RESULT, "steps": True}}), 1),
        ("n_in=str", json.dumps({"result": {**GOOD_RESULT, "n_in": "5"}}), 1),
        ("violation=1", json.dumps({"result": {**GOOD_RESULT, "violation": 1}}), 1),
        ("violation true, no layers", json.dumps({"result": {**GOOD_RESULT, "violation": True}}), 1),
        ("OK but layers violate", json.dumps({"result": {**GOOD_RESULT, "violating_layers": ["fc"]}}), 1),
        ("delta=2", json.dumps({"result": {**GOOD_RESULT, "delta": 2}}), 1),
        ("confidence=-1", json.dumps({"result": {**GOOD_RESULT, "confidence": -1}}), 1),
        ("no observations but OK", json.dumps({"result": {**GOOD_RESULT, "n_in": 0, "n_out": 0}}), 0),
        ("missing delta", json.dumps({"result": {k: v for k, v in GOOD_RESULT.items() if k != "delta"}}), 1),
        ("truncated", json.dumps({"result": GOOD_RESULT})[:40], 1),
        ("utf16", json.dumps({"result": GOOD_RESULT}).encode("utf-16"), 1),
        ("deep nesting", "[" * 100000 + "]" * 100000, 1),
        ("huge number", '{"result": {"steps": 1' + "0" * 5000 + "}}", 1),
        ("final_model=list", json.dumps({"result": GOOD_RESULT, "final_model": [1]}), 1),
        ("layers=dict", json.dumps({"result": {**GOOD_RESULT, "layers": {"a": 1}}}), 1),
        ("good", json.dumps({"result": GOOD_RESULT}), 0),
        ("good violation", json.dumps({"result": {**GOOD_RESULT, "violation": True, "violating_layers": ["pooled"],
                                                  "first_violation_step": 3}}), 3),
    ]
    cases = []
    for label, content, status in damaged:
        expect = REFUSED if status == 1 else HANDLED
        cases.append(Case(f"report/{label}", "reports", expect, _report_case(content, status)))
    return cases


def _report_case(content, status):
    def run():
        import contextlib
        import io

        from lightning_dpaudit.app.cli import main

        root = tempfile.mkdtemp()
        with open(os.path.join(root, "audit_report.json"), "wb") as f:
            f.write(content if isinstance(content, bytes) else content.encode())
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(["report", root])
        except SystemExit as exit_:
            code = exit_.code
        except BaseException as error:  # noqa: BLE001
            return "raw", describe(error)
        lines = err.getvalue().strip().splitlines()
        if status == 1:
            if code == 1 and len(lines) == 1 and "audit_report.json" in lines[0]:
                return "refused", lines[0][-150:]
            if code == 1:
                return "raw", f"exit 1 with {len(lines)} stderr lines: {(lines or [''])[-1][:120]}"
            return "silent-wrong", f"exit {code}: {out.getvalue().strip().splitlines()[0][:80] if out.getvalue() else ''}"
        if code == status:
            head = out.getvalue().strip().splitlines()
            return "handled", f"exit {code}: {(head[1] if len(head) > 1 else '')[:80]}"
        return ("raw" if code == 1 else "silent-wrong"), f"exit {code}, expected {status}: {(lines or [''])[-1][:120]}"
    return run


def cli_cases():
    argvs = [
        (["demo", "--steps", "2", "--canaries", "4"], HANDLED),
        (["demo", "--steps", "2", "--canary", "random", "--canaries", "4"], HANDLED),
        (["demo", "--steps", "2", "--no-audit"], HANDLED),
        (["demo", "--steps", "2", "--canary", "mislabeled", "--canaries", "4"], HANDLED),
        (["demo", "--steps", "2", "--canaries", "4", "--final-model", "20"], HANDLED),
        (["demo", "--steps", "2", "--bug", "no-such"], REFUSED),
        (["demo", "--list-bugs"], HANDLED),
        (["demo", "--steps", "0"], REFUSED), (["demo", "--steps", "x"], REFUSED), (["demo", "--steps", ""], REFUSED),
        (["demo", "--steps", "1e3"], REFUSED), (["demo", "--steps", str(10**30)], REFUSED),
        (["demo", "--canaries", "1"], REFUSED), (["demo", "--canaries", str(10**12)], REFUSED),
        (["demo", "--noise-multiplier", "-1"], REFUSED), (["demo", "--noise-multiplier", "inf"], REFUSED),
        (["demo", "--noise-multiplier", "1e-300", "--steps", "2", "--canaries", "4"], "refused"),  # noise 0 in float32
        (["demo", "--noise-multiplier", "abc"], REFUSED), (["demo", "--seed", "-5"], REFUSED),
        (["demo", "--seed", str(2**70), "--steps", "2", "--canaries", "4"], REFUSED),
        (["demo", "--threads", "0"], REFUSED), (["demo", "--canary", "DIRAC"], REFUSED),
        (["demo", "--final-model", "1"], REFUSED), (["demo", "--final-model", str(10**9)], REFUSED),
        (["demo", "--final-model-kind", "ood"], REFUSED), (["demo", "--no-audit", "--canaries", "4"], REFUSED),
        (["report"], REFUSED), (["report", "/nonexistent/dir"], REFUSED), (["report", "/etc/passwd"], REFUSED),
        (["demo", "--out", "/etc/passwd/x"], REFUSED), (["demo", "--out", "/proc/forbidden"], REFUSED),
        (["--help"], HANDLED), (["demo", "--help"], HANDLED), ([], REFUSED), (["bogus"], REFUSED),
        (["report", "EMPTYDIR"], REFUSED),
    ]
    return [Case(f"cli/{' '.join(a) or '(none)'}"[:70], "cli", e, _cli_case(a, e)) for a, e in argvs]


def _cli_case(argv, expect):
    def run():
        quiet()
        import contextlib
        import io
        import logging

        logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
        from lightning_dpaudit.app.cli import main

        root = tempfile.mkdtemp()
        args = [root if a == "EMPTYDIR" else a for a in argv]
        if args[:1] == ["demo"] and "--out" not in args and "--help" not in args:
            args += ["--out", root, "--no-progress-bar", "--threads", "1"]
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                code = main(args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException as error:  # noqa: BLE001
            return "raw", describe(error)
        lines = err.getvalue().strip().splitlines()
        if expect == REFUSED:
            if code != 0 and lines and (len(lines) <= 3 or (code == 2 and "error:" in lines[-1])):
                return "refused", f"exit {code}: {lines[-1][:130]}"
            if code != 0:
                return "raw", f"exit {code} with {len(lines)} stderr lines: {(lines or [''])[-1][:120]}"
            return "silent-wrong", f"exit 0: {out.getvalue().strip()[:100]}"
        if code != 0:
            return ("late" if lines and len(lines) <= 3 else "raw"), f"exit {code}: {(lines or [''])[-1][:130]}"
        if "demo" in argv and "--list-bugs" not in argv and "--help" not in argv:
            reports = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f == "audit_report.json"]
            if "--no-audit" in argv:
                return ("handled" if not reports else "silent-wrong"), f"exit 0, {len(reports)} reports"
            if not reports:
                return "silent-wrong", "exit 0 but no audit_report.json"
            report = json.load(open(reports[0]))
            result = report["result"]
            # sigma 1e-300: float32 draws that noise as 0 every step, which the noise-repeat test rightly reports
            zero_noise = "1e-300" in argv and result["violation"] and "noise" in json.dumps(report).lower()
            if result["n_in"] + result["n_out"] == 0 or (result["violation"] and not zero_noise):
                return "silent-wrong", f"report: n_in {result['n_in']}, violation {result['violation']}"
            return "handled", f"exit 0, report: {result['steps']} steps, {result['n_in'] + result['n_out']} obs"
        return "handled", f"exit 0: {out.getvalue().strip().splitlines()[0][:80] if out.getvalue().strip() else ''}"
    return run
