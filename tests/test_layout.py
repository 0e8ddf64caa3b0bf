"""The layout docs/design.md describes, checked on the source: the one direction of imports (kernels
below the op library, the training application and the integrations above it, all as plain import
statements), and its Layout section against the files git tracks; and that code and tests leave
history and measured figures to docs/, bench/results/ and the commit log."""

import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
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


# ------------------------------------------------------------------------------------------------
# docs/design.md's Layout section: one bullet per path, the path first, in backticks.
# ------------------------------------------------------------------------------------------------

DESIGN = REPO / "docs" / "design.md"
# Folders whose files the Layout lists one by one: (folder, file suffix or "" for every file).
LISTED_PER_FILE = (("fused_remat/", ".py"), ("fused_remat/training/", ""), ("fused_remat/integrations/", ""),
                   ("fused_remat/integrations/huggingface/", ""), ("kernels/", ""), ("bench/", ".py"), ("tests/", ".py"))


def _layout_paths() -> list[str]:
    text = DESIGN.read_text()
    match = re.search(r"^## Layout\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"{DESIGN.relative_to(REPO)} has no '## Layout' section"
    return re.findall(r"^- `([^`]+)`", match.group(1), re.M)


def _tracked_files() -> list[str]:
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout: nothing to compare the layout with")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in listed.decode().split("\0") if name]


def test_every_path_the_layout_names_exists():
    paths = _layout_paths()
    assert paths, "the Layout section lists no paths"
    missing = [p for p in paths if not (REPO / p).exists()]
    assert not missing, f"docs/design.md's Layout names paths that do not exist: {missing}"
    assert len(paths) == len(set(paths)), "the Layout lists a path twice"


def test_the_layout_lists_every_tracked_top_level_entry_and_code_file():
    listed = set(_layout_paths())
    tracked = _tracked_files()
    top = {name.split("/")[0] + ("/" if "/" in name else "") for name in tracked}
    per_file = {name for name in tracked for folder, suffix in LISTED_PER_FILE
                if name.startswith(folder) and "/" not in name[len(folder):] and name.endswith(suffix)}
    missing = sorted((top | per_file) - listed)
    assert not missing, f"tracked but not in docs/design.md's Layout: {missing}"


# A tracker reference (a hash or the word issue before a number) or a calendar date in code:
# history belongs in docs/, bench/results/ and the commit log.
_HISTORY = re.compile(r"(?<![\w&/])#\d+\b|\bissue \d+\b|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
_CODE_SUFFIXES = (".py", ".sh", ".toml", ".cfg", "Makefile")


def test_no_tracker_numbers_or_dates_in_code_or_tests():
    found = []
    for name in _tracked_files():
        if name.startswith(("docs/", "bench/results/")) or not name.endswith(_CODE_SUFFIXES) or not (REPO / name).is_file():
            continue
        for number, line in enumerate((REPO / name).read_text().splitlines(), 1):
            if _HISTORY.search(line):
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "tracker numbers or dates in code (move them to docs/ or the commit message):\n" + "\n".join(found)


# A measured figure (a number with a unit of time or throughput) in a comment or a docstring: the
# figure belongs in bench/results/ (generated) or docs/tuning.md, the comment keeps the reason.
# Only prose is read: comments (tokenize) and bare string statements (ast: docstrings), so code
# such as ``timeout_ms = 5`` and strings a test asserts in a generated report pass.
_MEASUREMENT = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s*-\s*\d+(?:\.\d+)?)?\s*"
                          r"(?:us|µs|μs|ns|ms|[GMT]i?B/s|TFLOP/s|TFLOPS|TFLOPs)(?![\w/])")


def _prose(source: str) -> list[tuple[int, str]]:
    """(line number, text) of every comment and every line of a bare string statement in ``source``."""
    lines = [(token.start[0], token.string) for token in tokenize.generate_tokens(io.StringIO(source).readline)
             if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines += [(node.lineno + offset, text) for offset, text in enumerate(node.value.value.splitlines())]
    return sorted(lines)


def test_measurement_pattern_reads_only_figures():
    found = {"# 12 ms on the GPU", "# 3.5 µs a call", "# 0.5-2 us", "# 1,200 GB/s", "# 750 TFLOP/s",
             "# 3 TB/s", "# 95 TFLOPS"}
    passed = {"# timeout_ms", "# 2 users", "# ms per step", "# GB/s against hidden size", "# 7.6 TFLOP of work",
              "# sm_90 use", "# v1.2 ms_per_step"}
    assert all(_MEASUREMENT.search(text) for text in found), [t for t in found if not _MEASUREMENT.search(t)]
    assert not any(_MEASUREMENT.search(text) for text in passed), [t for t in passed if _MEASUREMENT.search(t)]
    source = 'timeout_ms = 12\nlabel = "4 ms"\n\n\ndef f():\n    """Took 4 ms."""\n    return 1  # 9 us\n'
    assert [number for number, text in _prose(source) if _MEASUREMENT.search(text)] == [6, 7]


def test_no_measurements_in_code_comments_or_docstrings():
    found = []
    for name in _tracked_files():
        if name.startswith(("docs/", "bench/results/")) or not name.endswith(".py") or not (REPO / name).is_file():
            continue
        for number, text in _prose((REPO / name).read_text()):
            if _MEASUREMENT.search(text):
                found.append(f"{name}:{number}: {text.strip()}")
    assert not found, ("measured figures in comments or docstrings (keep the reason there, move the figure to "
                       "bench/results/ or docs/tuning.md):\n" + "\n".join(found))
