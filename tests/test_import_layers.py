"""The package's rooms import in one direction (docs/architecture.md, "Rooms").

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are checked by import-linter
on the source as it stands: an import that runs up a layer (the engine importing the router, the
KV transfer importing the engine, torch in the scheduling core, two modules of one room importing
each other), type-only ones included, fails.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def lint(root: pathlib.Path) -> subprocess.CompletedProcess:
    """import-linter over the package under ``root`` with the contracts of ``root/pyproject.toml``."""
    code = ("import sys; sys.path.insert(0, '.'); from importlinter.cli import lint_imports; "
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))")
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)


def test_every_import_contract_is_kept():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "Contracts: 4 kept, 0 broken" in result.stdout, result.stdout[-2000:]


@pytest.mark.parametrize("importer,imported", [
    ("pdserve/engine/core.py", "pdserve.router.app"),  # the engine knows nothing of routers
    ("pdserve/kvtransfer/wire.py", "pdserve.engine.config"),  # the transfer knows the KV layout as data only
    ("pdserve/engine/layers/base.py", "pdserve.engine.execution.model_runner"),  # layers below execution
    ("pdserve/engine/scheduling/request.py", "torch"),  # the scheduling core is torch-free
    ("pdserve/kvtransfer/pair.py", "pdserve.kvtransfer.sender"),  # no cycle between sibling modules
])
def test_an_upward_import_breaks_a_contract(tmp_path, importer, imported):
    """The same contracts over a copy of the package with one upward import added, type-only, must fail."""
    shutil.copytree(ROOT / "pdserve", tmp_path / "pdserve", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / importer
    target.write_text(target.read_text() + f"\nif TYPE_CHECKING:\n    import {imported}  # noqa: F401\n")
    result = lint(tmp_path)
    assert result.returncode != 0, result.stdout[-2000:]
    assert "BROKEN" in result.stdout.upper() and imported.rsplit(".", 1)[-1] in result.stdout, result.stdout[-2000:]


def test_no_test_module_imports_another():
    """Shared test code lives in ``tests/helpers``; a test module importing another would run its module
    fixtures and couple the two files."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else \
                [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                          if n.split(".")[-1].startswith("test_") and n.startswith("tests.")]
    assert not offenders, offenders
