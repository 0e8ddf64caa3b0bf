"""The package as a user installs it: a wheel built from this checkout goes into an empty virtual
environment (the CPU torch first, as on any machine without CUDA), and its command lines run from
a folder outside the repository, so nothing of the checkout can stand in for what the wheel lacks."""

import subprocess
import sys
import venv
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _run(command: list, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([str(part) for part in command], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.skipif(torch.cuda.is_available(), reason="installs the CPU torch wheel; the GPU machines have no network")
def test_the_wheel_installs_into_an_empty_venv_and_its_command_lines_run(tmp_path):
    dist, user = tmp_path / "dist", tmp_path / "user"
    user.mkdir()
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w", dist, REPO], tmp_path)
    wheel = next(dist.glob("fused_remat-*.whl"))
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    _run([python, "-m", "pip", "install", "--quiet", f"torch=={torch.__version__.split('+')[0]}"], user)
    _run([python, "-m", "pip", "install", "--quiet", f"{wheel}[train]"], user)

    for module in ("fused_remat", "fused_remat.train"):
        done = _run([python, "-m", module, "--help"], user)
        assert done.stdout.startswith(f"usage: python -m {module}")
        assert "NumPy" not in done.stderr and "numpy" not in done.stderr, "numpy is a declared dependency"
    done = _run([python, "-m", "fused_remat.train", "--preset", "tiny", "--steps", "2", "--seq-len", "32",
                 "--batch-size", "2", "--eval-interval", "2", "--eval-batches", "1", "--backend", "reference",
                 "--out", "run"], user)
    assert "plot: run/training.png" in done.stdout
    assert (user / "run" / "training.png").stat().st_size > 0
    assert (user / "run" / "checkpoint.pt").is_file()
