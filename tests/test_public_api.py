"""The public import surface: every name in `lightning_dpaudit.__all__` imports from the package,
the torch-free parts stay torch-free, results print as the summary, and every import in
README.md, docs/ and examples/ names a current module path and a name it defines."""

import ast
import importlib
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import lightning_dpaudit
from lightning_dpaudit import _compat

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
IMPORT_LINE = re.compile(r"^\s*(?:from|import)\s+lightning_dpaudit\b.*$", re.M)
# Public names come from the top level; the estimators keep their own documented, torch-free module.
PUBLIC_FROM = {"lightning_dpaudit", "lightning_dpaudit.estimators"}


def test_every_public_name_imports_from_the_package():
    names = lightning_dpaudit.__all__
    assert len(names) == len(set(names))
    for name in names:
        assert getattr(lightning_dpaudit, name) is not None, name
    namespace = {}
    exec("from lightning_dpaudit import *", namespace)
    assert set(names) <= set(namespace)
    assert set(names) <= set(dir(lightning_dpaudit))
    with pytest.raises(AttributeError):
        lightning_dpaudit.NoSuchName  # noqa: B018


def test_the_documented_names_are_public():
    documented = {
        "PrivacyAuditor", "DPAuditCallback", "AuditResult", "Finding", "LayerAudit", "FinalModelCanaries",
        "CanaryDataModule", "FinalModelResult", "PrivacyViolationError", "PrivacyViolationWarning",
        "AuditFailedWarning", "AuditStateError", "InputCanaries", "Check", "default_checks", "CheckStoppedWarning",
    }
    assert documented == set(lightning_dpaudit.__all__) - {"__version__"}  # the audit, its checks, results, errors
    from lightning_dpaudit.engine.step.pipeline import AuditFailedWarning
    from lightning_dpaudit.engine.state import AuditStateError

    assert lightning_dpaudit.AuditFailedWarning is AuditFailedWarning
    assert lightning_dpaudit.AuditStateError is AuditStateError


@pytest.mark.parametrize("module,names", [
    ("datasets", ["DigitsCNN", "digits_dataset", "digits_holdout", "make_private_digits", "train_steps"]),
    ("testing", ["audit_optimizer", "train_audited", "PrivacyAuditFailure", "inject_bug", "list_bugs", "historical_bug"]),
    ("estimators", ["epsilon_lower_bound", "mu_to_epsilon", "end_to_end_epsilon", "EpsilonEstimate"]),
])
def test_names_that_moved_to_a_module_of_their_own_still_resolve_with_a_deprecation_warning(module, names):
    moved_to = importlib.import_module(f"lightning_dpaudit.{module}")
    for name in names:
        with pytest.warns(DeprecationWarning, match=f"`lightning_dpaudit.{name}` moved to `lightning_dpaudit.{module}"):
            old = getattr(lightning_dpaudit, name)
        assert old is getattr(moved_to, name) and name not in lightning_dpaudit.__all__


@pytest.mark.parametrize("statement", [
    "import lightning_dpaudit.estimators",
    "import lightning_dpaudit",
    "from lightning_dpaudit import AuditResult, Finding, FinalModelResult, epsilon_lower_bound",
])
def test_the_torch_free_parts_do_not_import_torch(statement):
    heavy = "sorted({'torch', 'pytorch_lightning', 'lightning', 'opacus'} & set(sys.modules))"
    code = f"import sys\n{statement}\nprint({heavy})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", f"{statement} imported {done.stdout.strip()}"


def _result(violation: bool):
    from lightning_dpaudit import AuditResult, Finding, LayerAudit

    layer = LayerAudit(name="fc.weight", mu_lower_bound=4.9 if violation else 0.9, mu_lower_bound_anytime=1.5,
                       mu_claimed=1.0, n_in=512, n_out=512, violation=violation)
    findings = (Finding(code="noise_scale", message="noise std 0.0165 x claimed", first_step=1),) if violation else ()
    return AuditResult(
        epsilon_lower_bound=30.0 if violation else 3.5, epsilon_accountant=3.7, mu_lower_bound=4.9 if violation else 0.98,
        mu_lower_bound_anytime=1.5 if violation else 0.95, mu_claimed=1.0, violation=violation,
        violating_layers=("pooled",) if violation else (), n_in=512, n_out=512, steps=200, estimator="gdp-cp",
        confidence=0.95, delta=1e-5, epsilon_step_lower_bound=32.0 if violation else 4.3, epsilon_step_claimed=4.38,
        first_violation_step=1 if violation else None, noise_repeats=0, mode="one-run", canary="dirac",
        layers=(layer,), findings=findings,
    )


@pytest.mark.parametrize("violation", [False, True])
def test_an_audit_result_prints_as_the_summary(violation):
    from lightning_dpaudit.analysis.report import summary_table

    result = _result(violation)
    text = str(result)
    assert text == summary_table({"result": result.to_dict()}) == f"{result}"
    assert text.startswith("VIOLATION:" if violation else "OK:")
    assert "epsilon (delta=1e-05)" in text and "epsilon per step" in text and "mu per step" in text
    assert "fc.weight" in text and "3.70 (accountant)" in text
    assert ("noise_scale: noise std 0.0165 x claimed" in text) is violation
    assert repr(result).startswith("AuditResult(epsilon_lower_bound=")


def test_a_final_model_result_prints_its_summary_lines():
    from lightning_dpaudit import FinalModelResult
    from lightning_dpaudit.analysis.final_model import audit_final_model, summary_lines

    rng = np.random.default_rng(0)
    included = rng.random(200) < 0.5
    scores = {"loss": rng.normal(size=200) + 3.0 * included}
    result = audit_final_model(scores, included, delta=1e-5, accountant_epsilon=2.0, kind="ood", epoch=3)
    assert isinstance(result, FinalModelResult)
    text = str(result)
    assert text == "\n".join(summary_lines(result.to_dict()))
    assert text.startswith("Final model (200 ood canaries") and "epsilon, (eps, delta)-DP" in text
    assert ("VIOLATION" in text.splitlines()[0]) is result.violation
    assert repr(result).startswith("FinalModelResult(epoch=3")


def test_a_final_model_result_names_only_the_epoch_and_step_it_was_given():
    """A plain loop's audit gives neither: its first line names no "epoch None"; the callback's gives both."""
    from lightning_dpaudit.analysis.final_model import audit_final_model

    rng = np.random.default_rng(0)
    included = rng.random(200) < 0.5
    scores = {"loss": rng.normal(size=200)}
    plain = str(audit_final_model(scores, included, delta=1e-5, kind="ood")).splitlines()[0]
    assert plain.startswith("Final model (200 ood canaries, ") and plain.endswith(" trained on): OK: within the claim")
    assert "None" not in plain
    both = str(audit_final_model(scores, included, delta=1e-5, kind="ood", epoch=2, step=60)).splitlines()[0]
    assert " trained on; epoch 2, step 60): " in both


def test_the_auditor_summary_is_the_printed_result():
    import torch

    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.integrations.digits import make_private_digits, train_steps

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, optimizer, loader, _ = make_private_digits(seed=0)
        auditor = PrivacyAuditor(optimizer, delta=1e-5, module=model, seed=0, per_sample_check_every=0)
        train_steps(model, optimizer, loader, 5)
        summary = auditor.summary()
        result = auditor.result()
    finally:
        torch.set_num_threads(threads)
    assert summary == str(result) and summary.startswith("OK:")
    assert "epsilon (delta=1e-05)" in summary and math.isfinite(result.epsilon_accountant)


def _import_statements(path: Path):
    """Each import of the package in a file: (line number, module, names or None for `import module`)."""
    text = path.read_text()
    if path.suffix == ".py":
        segments = [(0, text)]
    else:
        segments = [(text[:m.start(1)].count("\n"), m.group(1)) for m in BLOCK.finditer(text)]
        inside = {i for offset, code in segments for i in range(offset, offset + code.count("\n") + 1)}
        segments += [(text[:m.start()].count("\n"), m.group().strip()) for m in IMPORT_LINE.finditer(text)
                     if text[:m.start()].count("\n") not in inside]
    found = []
    for offset, code in segments:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == "lightning_dpaudit":
                found.append((offset + node.lineno, node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                found += [(offset + node.lineno, a.name, None) for a in node.names if a.name.split(".")[0] == "lightning_dpaudit"]
    return found


def _imports():
    for path in [*PAGES, *EXAMPLES]:
        for line, module, names in _import_statements(path):
            yield pytest.param(module, names, id=f"{path.relative_to(ROOT)}:{line}")


def test_the_pages_and_examples_import_the_package():
    statements = list(_imports())
    assert len(statements) >= 20
    in_text = sum(len(IMPORT_LINE.findall(p.read_text())) for p in [*PAGES, *EXAMPLES])
    assert len(statements) >= in_text  # every import line in the text was parsed


@pytest.mark.parametrize("module,names", list(_imports()))
def test_every_documented_import_names_a_current_path_and_a_name_it_defines(module, names):
    assert module not in _compat.OLD_TO_NEW, f"{module} is a 0.1.0 path; use {_compat.OLD_TO_NEW.get(module)}"
    imported = importlib.import_module(module)
    for name in names or ():
        assert hasattr(imported, name), f"{module} defines no {name}"
        if name in lightning_dpaudit.__all__:
            assert module in PUBLIC_FROM, f"{name} is public: import it from lightning_dpaudit, not {module}"
