"""The house's shape: the layering that pyproject.toml's import-linter contracts state holds (and
fails on a back-import), no module grows past about 400 lines (kernels excepted), and every
folder's __init__.py says in two lines what lives there."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "attnres"
MAX_LINES = 420  # "about 400"
KERNELS = {"ops/triton_fused.py", "ops/torch_fused.py", "ops/cpu_fused.py"}  # one op's kernels each, kept whole

pytest.importorskip("importlinter", reason="needs import-linter (the `test` extra)")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` with the repository's contracts, on the `attnres` package found in `root`."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = ("import sys; from importlinter.cli import lint_imports_command; "
            "sys.argv = ['lint-imports', sys.argv[1], '--no-cache', '--no-logo']; lint_imports_command()")
    return subprocess.run([sys.executable, "-c", code, str(ROOT / "pyproject.toml")], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


def test_the_import_contracts_hold():
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "3 kept, 0 broken" in out.stdout


@pytest.mark.parametrize(("module", "back_import", "broken"), [
    ("results/verdict.py", "from attnres.training import lit", "attnres.results is not allowed to import"),
    ("config/naming.py", "from attnres.sweep import plan", "attnres.config is not allowed to import"),
    ("sweep/slots.py", "from attnres.sweep import job", "No cycles are allowed in attnres.sweep"),
    ("residual/block.py", "import pytorch_lightning", "the library is plain PyTorch"),
], ids=["results->training", "config->sweep", "sweep-cycle", "library->lightning"])
def test_a_deliberate_back_import_breaks_a_contract(tmp_path, module, back_import, broken):
    copy = tmp_path / "attnres"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "*.so", "csrc"))
    with open(copy / module, "a") as f:
        f.write(f"\n{back_import}  # noqa\n")
    out = _lint_imports(tmp_path)
    assert out.returncode != 0, f"the contracts did not notice {back_import} in {module}"
    assert broken in out.stdout, out.stdout[-3000:]


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_module_is_over_about_400_lines(path):
    name = path.relative_to(PACKAGE).as_posix()
    lines = len(path.read_text().splitlines())
    if name in KERNELS:
        pytest.skip(f"{name} holds one op's kernels ({lines} lines)")
    assert lines <= MAX_LINES, f"{name} has {lines} lines; split it by concern"


FOLDERS = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_folder_says_what_lives_there(folder):
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    assert doc, f"{folder.relative_to(ROOT)}/__init__.py has no docstring"
    if folder != PACKAGE:  # the package's own is its front page
        assert len(doc.splitlines()) <= 2, f"{folder.relative_to(ROOT)}/__init__.py: say it in two lines"
