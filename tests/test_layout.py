"""The one direction of imports the design relies on, checked on the source: kernels below the op
library, the training application and the integrations above it, all as plain import statements."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LIBRARY = REPO / "fused_remat"
APPLICATIONS = ("training", "integrations")


def _imports(path: Path) -> list[str]:
    """Absolute names of every module ``path`` imports, relative imports resolved."""
    package = path.relative_to(REPO).with_suffix("").parts[:-1]
    if path.parent == REPO / "kernels":
        package = ("fused_remat", "kernels")
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return names


def _library_modules() -> list[Path]:
    return [p for p in LIBRARY.rglob("*.py")
            if p.relative_to(LIBRARY).parts[0] not in APPLICATIONS and p.name != "train.py"]


@pytest.mark.parametrize("path", sorted((REPO / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_kernels_import_nothing_of_the_library_above_them(path):
    above = [name for name in _imports(path)
             if name.startswith("fused_remat") and not name.startswith("fused_remat.kernels")]
    assert not above, f"{path.name} imports {above}"


def test_the_library_never_imports_the_applications():
    offenders = {}
    for path in _library_modules():
        upward = [n for n in _imports(path) if any(n.startswith(f"fused_remat.{app}") for app in APPLICATIONS)]
        if upward:
            offenders[str(path.relative_to(REPO))] = upward
    assert not offenders


def test_the_library_reaches_the_kernels_by_plain_imports():
    for path in _library_modules():
        tree = ast.parse(path.read_text())
        called = {node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
                  for node in ast.walk(tree) if isinstance(node, ast.Call)}
        assert "import_module" not in called, f"{path.name} dispatches by importlib.import_module"


def test_kernel_limits_import_without_triton():
    code = "import sys, fused_remat.kernels.limits; assert 'triton' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
