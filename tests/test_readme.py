"""The README as a user meets it: every example runs and every command names real things.

A fenced block's info string says what it is:

- ```python: runs on a CPU, as written, in a fresh interpreter in an empty folder, with the
  environment of a shell that set nothing (no TRITON_INTERPRET, no FUSED_REMAT_BACKEND, no GPU);
- ```python gpu: needs CUDA or a network, so it is only compiled (the README keeps few of them);
- ```bash: commands whose program, module, subcommand, flags, make target, extras and files must
  exist (flags are looked up in the command's own --help);
- ```bash run: the same, and each command is also run, in an empty folder;
- ```text: output, not checked.

The guides the README links to (docs/training.md, docs/results.md) are held to their links, their
```bash commands and the syntax of their Python."""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
GUIDES = (README, REPO / "docs" / "training.md", REPO / "docs" / "results.md")
README_FENCES = {"python", "python gpu", "bash", "bash run", "text"}
MAX_LINES = 300
MAX_GPU_EXAMPLES = 2
EXAMPLE_TIMEOUT = 240  # seconds; the examples are small, the margin is for a loaded CI machine
HELP_TIMEOUT = 120


@dataclasses.dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence
    info: str  # the fence's info string: "python", "python gpu", "bash run", ...
    code: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def fenced_blocks(path: Path) -> list[Block]:
    """Every fenced block of a Markdown file, its indentation (inside a list item) removed."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        opening = re.match(r"^(\s*)```(.*)$", lines[i])
        if opening:
            indent, start, body = len(opening.group(1)), i, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i][indent:])
                i += 1
            assert i < len(lines), f"{path.name}:{start + 1}: a fence that is never closed"
            blocks.append(Block(path.relative_to(REPO).as_posix(), start + 1, opening.group(2).strip(),
                                "\n".join(body) + "\n"))
        i += 1
    return blocks


def prose(path: Path) -> str:
    """A Markdown file without its fenced blocks."""
    return re.sub(r"^\s*```.*?^\s*```\s*$", "", path.read_text(), flags=re.S | re.M)


def guide_blocks(*infos: str, guides=GUIDES) -> list[Block]:
    return [block for path in guides for block in fenced_blocks(path) if block.info in infos]


def user_environment() -> dict[str, str]:
    """A shell that set nothing of ours, on a machine without a GPU; `python` is this interpreter."""
    env = {key: value for key, value in os.environ.items() if key not in ("TRITON_INTERPRET", "FUSED_REMAT_BACKEND")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


# ------------------------------------------------------------------------------------------------
# The README's shape
# ------------------------------------------------------------------------------------------------

def test_the_readme_is_a_guide_of_at_most_300_lines():
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


def test_every_readme_fence_says_what_it_is():
    unknown = [f"{block}: ```{block.info}" for block in fenced_blocks(README) if block.info not in README_FENCES]
    assert not unknown, f"fences other than {sorted(README_FENCES)}: {unknown}"
    gpu = guide_blocks("python gpu", guides=(README,))
    assert len(gpu) <= MAX_GPU_EXAMPLES, f"{len(gpu)} examples need a GPU: show the CPU form instead ({gpu})"


def test_the_readme_holds_no_dates_or_tracker_numbers():
    history = re.compile(r"(?<![\w&/])#\d+\b|\bissue \d+\b|\b20\d\d-[01]\d-[0-3]\d\b", re.IGNORECASE)
    found = [f"README.md:{number}: {line.strip()}"
             for number, line in enumerate(README.read_text().splitlines(), 1) if history.search(line)]
    assert not found, "history belongs in the commit log:\n" + "\n".join(found)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(match) for match in re.findall(r"^#+\s+(.*)$", prose(path), re.M)}


@pytest.mark.parametrize("path", GUIDES, ids=lambda p: p.name)
def test_every_local_link_leads_somewhere(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path)):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        file, _, anchor = target.partition("#")
        destination = (path.parent / file).resolve() if file else path
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (destination.suffix != ".md" or anchor not in _anchors(destination)):
            broken.append(f"{target}: no such heading")
    assert not broken, f"{path.relative_to(REPO)}: {broken}"


# ------------------------------------------------------------------------------------------------
# Python examples
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", guide_blocks("python", "python gpu"), ids=str)
def test_every_python_block_compiles(block):
    compile(block.code, str(block), "exec")


@pytest.mark.parametrize("block", guide_blocks("python", guides=(README,)), ids=str)
def test_readme_python_example_runs_on_a_cpu(block, tmp_path):
    if re.search(r"^\s*import transformers", block.code, re.M):
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    script = tmp_path / "example.py"
    script.write_text(block.code)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=user_environment(),
                            capture_output=True, text=True, timeout=EXAMPLE_TIMEOUT)
    assert result.returncode == 0, f"{block} failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"


# ------------------------------------------------------------------------------------------------
# Shell commands
# ------------------------------------------------------------------------------------------------

def commands(code: str) -> list[list[str]]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = code.replace("\\\n", " ")
    return [words for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


@functools.lru_cache(maxsize=None)
def help_text(*argv: str) -> str | None:
    """What ``argv`` answers (from the repository's root, where ``python -m bench`` runs), or None
    if it fails."""
    result = subprocess.run(list(argv), cwd=REPO, env=user_environment(), capture_output=True, text=True,
                            timeout=HELP_TIMEOUT)
    return result.stdout + result.stderr if result.returncode == 0 else None


@functools.lru_cache(maxsize=None)
def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirement_name(spec: str) -> str:
    return re.split(r"[\s<>=!~;\[]", spec, maxsplit=1)[0].lower()


def _mentions(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(word)}(?![\w-])", text) is not None


def _flags(args: list[str]) -> list[str]:
    return [arg.split("=", 1)[0] for arg in args if re.match(r"--?[A-Za-z]", arg)]


def _unknown_flags(args: list[str], text: str) -> list[str]:
    return [flag for flag in _flags(args) if not _mentions(text, flag)]


def _missing_files(args: list[str]) -> list[str]:
    return [arg for arg in args if arg.endswith((".py", ".sh")) and not (REPO / arg).exists()]


def check_module(module: str, args: list[str]) -> list[str]:
    """``python -m module args``: the module answers --help, its subcommand (a first argument
    that is not a flag) is one it names, and it knows every flag."""
    top = help_text(sys.executable, "-m", module, "--help")
    if top is None:
        return [f"python -m {module} --help fails"]
    text, problems = top, []
    if args and not args[0].startswith("-") and not args[0].endswith(".py"):
        if not _mentions(top, args[0]):
            problems.append(f"python -m {module} names no {args[0]!r}")
        text += help_text(sys.executable, "-m", module, args[0], "--help") or ""
    problems += [f"python -m {module} has no flag {flag}" for flag in _unknown_flags(args, text)]
    return problems + [f"no file {path}" for path in _missing_files(args)]


def check_pip(args: list[str]) -> list[str]:
    if args[:1] != ["install"]:
        return [f"pip {' '.join(args)}: only pip install is expected"]
    problems = [f"pip install has no flag {flag}"
                for flag in _unknown_flags(args[1:], help_text(sys.executable, "-m", "pip", "install", "--help") or "")]
    project = pyproject()["project"]
    extras = project["optional-dependencies"]
    declared = {_requirement_name(spec) for spec in project["dependencies"] + sum(extras.values(), [])}
    for arg in args[1:]:
        if arg.startswith("-"):
            continue
        local = re.fullmatch(r"([./][^\[]*)(?:\[([\w,-]+)\])?", arg)
        if local:
            if not (REPO / local.group(1)).exists():
                problems.append(f"pip install {arg}: no such path in the repository")
            problems += [f"pip install {arg}: no extra {extra!r} in pyproject.toml"
                         for extra in (local.group(2) or "").split(",") if extra and extra not in extras]
        elif _requirement_name(arg) not in declared:
            problems.append(f"pip install {arg}: not a dependency of the project")
    return problems


def check_command(words: list[str]) -> list[str]:
    """What is wrong with one command of a shell block (nothing: an empty list)."""
    while words and re.fullmatch(r"[A-Za-z_]\w*=\S*", words[0]):
        words = words[1:]  # VAR=value before the command
    head, args = words[0], words[1:]
    if head in ("python", "python3"):
        if args[:1] == ["-m"]:
            return check_pip(args[2:]) if args[1] == "pip" else check_module(args[1], args[2:])
        return [f"python {args[0]}: no such script"] if not (REPO / args[0]).is_file() else []
    if head == "pip":
        return check_pip(args)
    if head == "make":
        targets = set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.M))
        return [f"make has no target {target!r}" for target in args if target not in targets]
    if head == "torchrun":
        if "-m" not in args:
            return ["torchrun without -m module"]
        split = args.index("-m")
        problems = [f"torchrun has no flag {flag}"
                    for flag in _unknown_flags(args[:split], help_text("torchrun", "--help") or "")]
        return problems + check_module(args[split + 1], args[split + 2:])
    if head == "bash":
        script = REPO / args[0]
        if not script.exists():
            return [f"no script {args[0]}"]
        return [f"{args[0]} knows no {flag}" for flag in _unknown_flags(args[1:], script.read_text())]
    if head in (".", "source"):
        venv = re.search(r"^VENV \?= (\S+)", (REPO / "Makefile").read_text(), re.M).group(1)
        return [] if args[0].startswith(f"{venv}/") else [f"{head} {args[0]}: not the environment make creates"]
    return [f"{head}: a command this test does not know; teach it, or fence the block as text"]


@pytest.mark.parametrize("block", guide_blocks("bash", "bash run"), ids=str)
def test_shell_commands_name_real_things(block):
    problems = [f"{shlex.join(words)}: {problem}" for words in commands(block.code) for problem in check_command(words)]
    assert not problems, f"{block}:\n" + "\n".join(problems)


@pytest.mark.parametrize("block", guide_blocks("bash run", guides=(README,)), ids=str)
def test_readme_run_commands_succeed_on_a_cpu(block, tmp_path):
    for words in commands(block.code):
        argv = [sys.executable, *words[1:]] if words[0] in ("python", "python3") else words
        result = subprocess.run(argv, cwd=tmp_path, env=user_environment(), capture_output=True, text=True,
                                timeout=EXAMPLE_TIMEOUT)
        assert result.returncode == 0, f"{block}: {shlex.join(words)} failed:\n{result.stderr[-4000:]}"
