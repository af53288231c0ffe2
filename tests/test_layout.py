"""The package's shape: layers import downward only, no import circle, small modules and classes, old paths kept.

Read statically from the source (every `import`, at module level or inside a function): nothing is run.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from pathlib import Path

import pytest

from lightning_dpaudit import _compat

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dpaudit"
LAYERS = ["estimators", "analysis", "engine", "integrations", "app"]  # each imports only from those before it
MAX_MODULE_LINES, MAX_CLASS_LINES = 400, 300


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str) -> set:
    """The package's modules that module `name` imports (a name imported from a package counts as its module when
    it is one)."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in MODULES else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name) for name in MODULES}


def _layer(name: str):
    parts = name.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def test_layers_import_only_from_the_layers_below():
    upward = [(a, b) for a, targets in GRAPH.items() for b in targets
              if _layer(a) is not None and _layer(b) is not None and _layer(b) > _layer(a)]
    assert upward == []


def test_no_import_circle():
    """Tarjan's strongly connected components of the module graph: each must be a single module."""
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    # a package's __init__ gathering its own modules is not a circle of the design: leave packages' own faces out
    circles = [c for c in circles if not all(m.startswith(c[0]) for m in c)]
    assert circles == []


def test_no_module_and_no_class_is_too_long():
    too_long = [f"{name}: {len(p.read_text().splitlines())} lines" for name, p in MODULES.items()
                if len(p.read_text().splitlines()) > MAX_MODULE_LINES]
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_long.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert too_long == []


def test_the_engine_is_folders_by_concern():
    """The engine's root holds the audit's face and its set-up; everything else sits in a folder of its concern."""
    root = sorted(p.stem for p in (PACKAGE / "engine").glob("*.py") if p.stem != "__init__")
    assert root == ["assembly", "auditor", "findings_sink", "options", "state", "values"]
    folders = sorted(p.name for p in (PACKAGE / "engine").iterdir() if (p / "__init__.py").exists())
    assert folders == ["canaries", "checks", "claims", "final_model", "release", "step", "support"]


@pytest.mark.parametrize("old,new", sorted(_compat.FLAT_TO_FOLDERS.items()))
def test_an_engine_path_of_before_the_folders_still_imports_with_a_deprecation_warning(old, new):
    assert not (PACKAGE.parent / old.replace(".", "/")).exists() and not (PACKAGE.parent / f"{old.replace('.', '/')}.py").exists()
    sys.modules.pop(old, None)  # imported by an earlier test: import it afresh
    with pytest.warns(DeprecationWarning, match=f"`{old}` moved to `{new}`"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)


def test_the_auditor_is_a_thin_face():
    """PrivacyAuditor: at most 150 lines, its __init__ at most 40 (its parts are made by engine/assembly.py)."""
    tree = ast.parse((PACKAGE / "engine" / "auditor.py").read_text())
    auditor = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PrivacyAuditor")
    init = next(n for n in auditor.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assert auditor.end_lineno - auditor.lineno + 1 <= 150 and init.end_lineno - init.lineno + 1 <= 40


def test_the_auditors_moved_attributes_still_answer_with_a_deprecation_warning():
    from lightning_dpaudit import PrivacyAuditor
    from lightning_dpaudit.datasets import make_private_digits

    model, optimizer, _, _ = make_private_digits(seed=0)
    auditor = PrivacyAuditor(optimizer, module=model, seed=0, per_sample_check_every=0)
    for name, (new, _) in PrivacyAuditor.MOVED_ATTRIBUTES.items():
        with pytest.warns(DeprecationWarning, match=rf"`PrivacyAuditor.{name}` moved to `\.{re.escape(new)}`"):
            getattr(auditor, name)
    with pytest.warns(DeprecationWarning):
        assert auditor.per_step == auditor.options.canaries_per_step and auditor.probe is auditor.kind.probe
    with pytest.raises(AttributeError, match="no attribute 'nothing_of_the_kind'"):
        auditor.nothing_of_the_kind
    auditor.detach()


BENCH = PACKAGE.parent / "bench"


def _bench_scripts() -> list:
    """The scripts one runs in bench/'s role folders: every module there but the path helper and the modules other
    scripts load (a pytest plugin, the probe's case files)."""
    return sorted(p.name for p in BENCH.glob("*/*.py") if not p.name.startswith("_") and not p.name.endswith("_plugin.py"))


def test_bench_readme_lists_every_script():
    listed = set(re.findall(r"^\| `([a-z_]+\.py)` \|", (BENCH / "README.md").read_text(), flags=re.MULTILINE))
    scripts = _bench_scripts()
    assert len(scripts) >= 30, scripts  # the glob finds the role folders' scripts
    assert sorted(set(scripts) - listed) == [] and sorted(listed - set(scripts)) == []
