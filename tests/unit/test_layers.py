"""The package layers (docs/architecture.md, "Layout"), checked with import-linter on every import, including
those inside functions: the lab on top, then the commands, then roles and infra, then the library; no cycles; the product never
imports the lab."""

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
