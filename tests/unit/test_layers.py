"""The package layers (docs/architecture.md, "Layout"), checked with import-linter on every import, including
those inside functions: the lab on top, then the commands, then roles and infra, then the library; no cycles; the product never
imports the lab (the lab adds its commands to the CLI through entry points)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_point_one_way_and_no_package_has_a_cycle():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 kept, 0 broken" in proc.stdout


def _lab_imports(source: str) -> list[int]:
    """The lines of `source` that import the lab: an import statement, or `import_module` / `__import__` by name."""
    import ast

    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if not node.level else []
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            names = [str(node.args[0].value)] if func in ("import_module", "__import__") else []
        else:
            names = []
        if any(name == "lab" or name.startswith("lab.") for name in names):
            lines.append(node.lineno)
    return lines


def test_no_module_of_the_product_imports_the_lab():
    """Not one exception: the contracts about the lab ignore no import, and no module of the product imports
    it, by an import statement or by name at run time (which import-linter cannot see)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    forbidden, = [c for c in contracts if c["type"] == "forbidden" and c["forbidden_modules"] == ["lab"]]
    assert set(forbidden["source_modules"]) == {"pipeline", "producers", "consumers", "infra", "heterorl"}
    layers, = [c for c in contracts if c["type"] == "layers" and "lab" in c["layers"]]
    assert "ignore_imports" not in forbidden and "ignore_imports" not in layers
    assert _lab_imports("import lab.chaos\nfrom lab.commands import study\nimportlib.import_module('lab.wan')\n"
                        "from . import lab\nimport laboratory\n") == [1, 2, 3]
    found = [f"{path.relative_to(ROOT)}:{line}" for package in ("pipeline", "producers", "consumers", "infra", "heterorl")
             for path in sorted((ROOT / package).rglob("*.py")) for line in _lab_imports(path.read_text())]
    assert found == []


def test_the_library_needs_nothing_above_it():
    """`pipeline` imports in a fresh interpreter without any other package of ours being loaded."""
    code = ("import sys, pkgutil, importlib, pipeline\n"
            "for m in pkgutil.walk_packages(pipeline.__path__, 'pipeline.'): importlib.import_module(m.name)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'heterorl', 'producers', 'consumers', 'infra', 'lab'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_part_of_the_library_says_what_it_holds():
    """Each subpackage of `pipeline` opens with one line of purpose, and the top level stays small."""
    import ast
    parts = [p for p in (ROOT / "pipeline").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(list((ROOT / "pipeline").glob("*.py"))) + len(parts) <= 14
    for part in parts:
        doc = ast.get_docstring(ast.parse((part / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, part.name



def test_no_function_of_the_product_runs_past_80_lines():
    """A reader keeps the thread of a product function (the lab's studies and rigs are not held to it)."""
    import ast
    long = []
    for package in ("pipeline", "producers", "consumers", "infra", "heterorl"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > 80:
                        long.append(f"{path.relative_to(ROOT)}:{node.name} ({lines} lines)")
    assert long == []


def test_the_sampler_class_stays_readable():
    """The sampler's class reads as the loop it runs, its parts elsewhere (`Outbox`, `Pauses`,
    `make_sampler_engine`, `connect_sampler`): at most 300 lines (it had grown to 384)."""
    import ast
    sampler, = [node for node in ast.parse((ROOT / "producers/sampler.py").read_text()).body
                if isinstance(node, ast.ClassDef) and node.name == "Sampler"]
    assert sampler.end_lineno - sampler.lineno + 1 <= 300


def test_the_learner_class_stays_readable():
    """The learner's class reads as the loop it runs, its parts in rooms of their own (`Intake`,
    `Checkpoints`, `LearnerLogs`, `StepRecorder`): at most 300 lines (it had grown to 335)."""
    import ast
    learner, = [node for node in ast.parse((ROOT / "consumers/learner.py").read_text()).body
                if isinstance(node, ast.ClassDef) and node.name == "Learner"]
    assert learner.end_lineno - learner.lineno + 1 <= 300
