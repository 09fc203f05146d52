"""The package layers (docs/architecture.md, "Layout"), checked with import-linter on every import, including
those inside functions: commands on top, then roles and infra, then the library; no cycles."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_imports_point_one_way_and_no_package_has_a_cycle():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache", "--no-logo"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "3 kept, 0 broken" in proc.stdout


def test_the_library_needs_nothing_above_it():
    """`pipeline` imports in a fresh interpreter without any other package of ours being loaded."""
    code = ("import sys, pkgutil, importlib, pipeline\n"
            "for m in pkgutil.walk_packages(pipeline.__path__, 'pipeline.'): importlib.import_module(m.name)\n"
            "print(sorted({n.split('.')[0] for n in sys.modules} & {'heterorl', 'producers', 'consumers', 'infra'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_every_part_of_the_library_says_what_it_holds():
    """Each subpackage of `pipeline` opens with one line of purpose, and the top level stays small."""
    import ast
    parts = [p for p in (ROOT / "pipeline").iterdir() if p.is_dir() and (p / "__init__.py").exists()]
    assert len(list((ROOT / "pipeline").glob("*.py"))) + len(parts) <= 13
    for part in parts:
        doc = ast.get_docstring(ast.parse((part / "__init__.py").read_text()))
        assert doc and len(doc.splitlines()[0]) > 20, part.name

