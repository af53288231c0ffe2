"""Opacus's own test suite, run plain and with the audit on every DP optimizer its tests make.

    python bench/validity/opacus_suite.py [--files randomness_test.py ...] [--out DIR] [--timeout SECONDS]

For each file, two pytest processes (one at a time, OMP_NUM_THREADS=1, no xdist), both loading
opacus_suite_plugin.py from this folder: the plain pass, then the audited pass (DPAUDIT_SUITE_AUDIT=1). The plugin
writes each test's outcome, and in the audited pass one JSON line per DP optimizer: its findings, the audit's own
errors, stopped checks, notes. The table shows, per file, whether every outcome is unchanged, how many optimizers
were audited, the audit's errors, the attach refusals, the stopped checks and the findings by code; below it every
changed outcome, error, refusal, stopped check and finding, one line each, to be read against the test's set-up.

pytest runs with an empty ini of its own in --out (so no project's pytest configuration applies) and its rootdir
at Opacus's tests folder (test ids read `privacy_engine_test.py::...`). Opacus's tests need hypothesis, and
some torchvision (see the plugin for a torchvision whose compiled operators do not load).

Exit status 1 when an outcome changed, the audit recorded an error of its own, a check stopped, or a pass did not
finish; findings alone do not fail it (each is judged against its test's set-up).
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import lightning_dpaudit  # noqa: F401  (the audit the plugin attaches: the one beside this bench)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
FILES = (  # privacy_engine_test.py whole takes over 15 minutes here (ConvNet's test_noise_level alone 130 s): 5 classes
    "privacy_engine_test.py::PrivacyEngineTextTest", "privacy_engine_test.py::PrivacyEngineTiedWeightsTest",
    "privacy_engine_test.py::PrivacyEngineCustomLayerTest",
    "privacy_engine_test.py::PrivacyEngineTextHooksTest",  # wrap_model=False: GradSampleHooks on the user's model
    "privacy_engine_test.py::PrivacyEngineTiedWeightsTestFunctorch",  # grad_sample_mode="functorch"
    "privacy_engine_validation_test.py",
    "batch_memory_manager_test.py", "gradient_accumulation_test.py", "randomness_test.py",
    "grad_sample_module_fast_gradient_clipping_test.py", "grad_sample_hooks_fast_gradient_clipping_test.py",
    "accounting_noise_multiplier_test.py", "schedulers/noise_scheduler_test.py",
    "schedulers/grad_clip_scheduler_test.py", "dpdataloader_test.py",
)


def opacus_tests() -> Path:
    spec = importlib.util.find_spec("opacus")  # found, not imported
    if spec is None or spec.origin is None:
        sys.exit("opacus is not installed")
    return Path(spec.origin).parent / "tests"


def read_lines(path: Path) -> list:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_pass(name: str, selection: str, tests_dir: Path, out: Path, *, audit: bool, timeout: float,
             per_sample_every: int) -> dict:
    stem = selection.replace(".py", "").replace("/", "__").replace("::", "__")
    outcomes, audits, log = (out / f"{stem}.{name}.outcomes.jsonl", out / f"{stem}.{name}.audits.jsonl",
                             out / f"{stem}.{name}.log")
    for path in (outcomes, audits):
        path.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DPAUDIT_SUITE_AUDIT": "1" if audit else "0",
           "DPAUDIT_SUITE_OUTCOMES": str(outcomes), "DPAUDIT_SUITE_AUDITS": str(audits),
           "DPAUDIT_SUITE_PER_SAMPLE_EVERY": str(per_sample_every),
           "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    command = [sys.executable, "-m", "pytest", "-c", str(out / "pytest.ini"), "--rootdir", str(tests_dir),
               "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "opacus_suite_plugin", "-q", "-rN",
               "-W", "ignore::DeprecationWarning", str(tests_dir / selection)]
    start, status = time.perf_counter(), None
    with open(log, "w") as handle:
        try:
            status = subprocess.run(command, cwd=out, env=env, stdout=handle, stderr=subprocess.STDOUT,
                                    timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    return {"status": status, "seconds": time.perf_counter() - start, "log": str(log),
            "outcomes": {line["test"]: line for line in read_lines(outcomes)}, "audits": read_lines(audits)}


def audit_errors(line: dict) -> list:
    return [f"{key}: {line[key]}" for key in ("audit_failed", "result_error", "detach_error") if line.get(key)]


def compare(name: str, plain: dict, audited: dict) -> dict:
    tests = sorted(set(plain["outcomes"]) | set(audited["outcomes"]))
    changed = []
    for test in tests:
        before = plain["outcomes"].get(test, {}).get("outcome", "missing")
        after = audited["outcomes"].get(test, {}).get("outcome", "missing")
        if before != after:
            changed.append((test, before, after, audited["outcomes"].get(test, {}).get("detail", "")))
    lines = audited["audits"]
    attached = [line for line in lines if "attach_refused" not in line]
    findings = collections.Counter(f["code"] for line in attached for f in line.get("findings", []))
    notes = collections.Counter(code for line in attached for code in line.get("notes", []))
    return {
        "file": name, "tests": len(tests), "plain": collections.Counter(o["outcome"] for o in plain["outcomes"].values()),
        "plain_status": plain["status"], "audited_status": audited["status"],
        "plain_seconds": plain["seconds"], "audited_seconds": audited["seconds"], "changed": changed,
        "optimizers": len(attached), "steps": sum(line.get("steps") or 0 for line in attached),
        "with_module": sum(bool(line.get("module")) for line in attached),
        "compared": sum((line.get("data_path") or "")[:1].isdigit() for line in attached),
        "errors": [(line["test"], e) for line in attached for e in audit_errors(line)],
        "refused": [(line["test"], line["optimizer"], line["attach_refused"]) for line in lines if "attach_refused" in line],
        "stopped": [(line["test"], s) for line in attached for s in line.get("checks_stopped", [])],
        "violations": sum(bool(line.get("violation")) for line in attached),
        "findings": findings, "notes": notes,
        "finding_lines": [(line["test"], line["optimizer"], f) for line in attached for f in line.get("findings", [])],
        "loader_refused": [(line["test"], line["loader"]) for line in attached if isinstance(line.get("loader"), str)],
    }


def counts(counter) -> str:
    return ", ".join(f"{code} {n}" for code, n in sorted(counter.items())) or "-"


def table(rows: list) -> str:
    out = ["| file | tests (plain outcomes) | plain s | audited s | outcomes unchanged | optimizers audited (steps) "
           "| with module / exact-compared | audit errors | attach refusals | checks stopped | violations "
           "| findings by code | notes by code |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        unfinished = [f"{k} pass: {r[k + '_status']}" for k in ("plain", "audited") if r[k + "_status"] not in (0, 1, 5)]
        unchanged = "no tests ran" if not r["tests"] else "yes" if not r["changed"] else "no: " + "; ".join(f"{t.split('::')[-1]} {a}->{b}" for t, a, b, _ in r["changed"])
        if unfinished:
            unchanged += " (" + ", ".join(unfinished) + ")"
        out.append(
            f"| {r['file']} | {r['tests']} ({counts(r['plain'])}) | {r['plain_seconds']:.0f} | {r['audited_seconds']:.0f} "
            f"| {unchanged} | {r['optimizers']} ({r['steps']}) | {r['with_module']} / {r['compared']} "
            f"| {len(r['errors'])} | {len(r['refused'])} "
            f"| {len(r['stopped'])} | {r['violations']} | {counts(r['findings'])} | {counts(r['notes'])} |")
    return "\n".join(out)


def details(rows: list) -> str:
    out = []
    for r in rows:
        items = ([f"- changed: `{t}` {a} -> {b}: {d}" for t, a, b, d in r["changed"]]
                 + [f"- audit error: `{t}`: {e}" for t, e in r["errors"]]
                 + [f"- attach refused: `{t}` ({o}): {e}" for t, o, e in r["refused"]]
                 + [f"- loader not watched: `{t}`: {e}" for t, e in r["loader_refused"]]
                 + [f"- check stopped: `{t}`: {s}" for t, s in r["stopped"]]
                 + [f"- finding `{f['code']}` (step {f['first_step']}): `{t}` ({o}): {f['message']}"
                    for t, o, f in r["finding_lines"]])
        if items:
            out += [f"### {r['file']}", *items, ""]
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--files", nargs="+", default=list(FILES),
                        help="test files relative to opacus/tests, or a class in one (file.py::Class)")
    parser.add_argument("--out", default="opacus_suite_out", help="folder for logs, JSON lines and the table")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per pass of one file")
    parser.add_argument("--per-sample-every", type=int, default=1, help="the auditor's per_sample_check_every")
    args = parser.parse_args(argv)

    tests_dir, out = opacus_tests(), Path(args.out).resolve()
    if importlib.util.find_spec("hypothesis") is None:
        sys.exit("Opacus's tests need hypothesis: pip install hypothesis (or put a folder holding it on PYTHONPATH)")
    if importlib.util.find_spec("torchvision") is None:
        print("torchvision is missing: privacy_engine_test.py and gradient_accumulation_test.py will not collect",
              file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / "pytest.ini").write_text("[pytest]\n")
    rows, start = [], time.perf_counter()
    for name in args.files:
        if not (tests_dir / name.split("::")[0]).exists():
            sys.exit(f"no such test file: {tests_dir / name.split('::')[0]}")
        passes = {kind: run_pass(kind, name, tests_dir, out, audit=kind == "audited", timeout=args.timeout,
                                 per_sample_every=args.per_sample_every) for kind in ("plain", "audited")}
        rows.append(compare(name, passes["plain"], passes["audited"]))
        r = rows[-1]
        print(f"{name}: {r['tests']} tests, plain {r['plain_seconds']:.0f} s, audited {r['audited_seconds']:.0f} s, "
              f"{len(r['changed'])} changed, {r['optimizers']} optimizers, {len(r['errors'])} errors", flush=True)
    report = (f"{table(rows)}\n\n{details(rows)}\nwall time {time.perf_counter() - start:.0f} s, "
              f"per_sample_check_every={args.per_sample_every}\n")
    (out / "table.md").write_text(report)
    (out / "summary.json").write_text(json.dumps(rows, indent=1, default=str))
    print("\n" + report)
    bad = any(r["changed"] or r["errors"] or r["stopped"] or not r["tests"] or r["plain_status"] not in (0, 1, 5)
              or r["audited_status"] not in (0, 1, 5) for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
