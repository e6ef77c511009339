"""scripts/install.sh --dry-run: which torch it asks pip for, with a faked GPU / torch.

No network: the dry run prints the pip commands and runs none."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def fake_env(
    tmp_path: Path, torch_version: str | None, gpu: bool, dist_version: str | None = None
) -> dict[str, str]:
    """PATH whose first entry has a fake ``nvidia-smi`` (lists a GPU or fails) and a
    ``python`` that imports a fake ``torch`` of ``torch_version`` (None: import fails),
    installed as the distribution ``dist_version`` (default: ``torch_version``)."""
    bin_dir, site = tmp_path / "bin", tmp_path / "site" / "torch"
    bin_dir.mkdir()
    site.mkdir(parents=True)
    (site / "__init__.py").write_text(
        f"__version__ = {torch_version!r}\n" if torch_version
        else "raise ImportError('no torch here')\n")
    if torch_version:  # pip's name for it (PyPI wheels: no local tag; torch's own has one)
        dist = site.parent / f"torch-{torch_version.split('+')[0]}.dist-info"
        dist.mkdir()
        version = dist_version or torch_version
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    smi = "echo 'GPU 0: NVIDIA H200 (UUID: GPU-0)'" if gpu else "echo 'NVIDIA-SMI has failed' >&2; exit 9"
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    (bin_dir / "python").write_text(
        f"#!/bin/sh\nPYTHONPATH={site.parent} exec {sys.executable} \"$@\"\n")
    for tool in ("nvidia-smi", "python"):
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TIDE_", "PYTHON"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", PYTHON=str(bin_dir / "python"))
    return env


def dry_run(env: dict[str, str], *args: str) -> list[str]:
    result = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--dry-run", *args],
                            capture_output=True, text=True, env=env, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == "[install] dry run: nothing was installed"
    return lines


def pip_commands(lines: list[str]) -> list[str]:
    return [line.split(" -m pip install -q ", 1)[1] for line in lines if " -m pip install " in line]


@pytest.mark.parametrize("torch_version", [None, "2.10.0+cu128"])
def test_cpu_build_where_no_gpu(tmp_path, torch_version):
    lines = dry_run(fake_env(tmp_path, torch_version, gpu=False), "--dev")
    commands = pip_commands(lines)
    assert commands[0] == "torch==2.13.0+cpu"  # configured sources first (find-links, mirrors)
    assert commands[1] == f"{CPU_INDEX} torch==2.13.0+cpu"  # then PyTorch's CPU index
    assert commands[2].startswith("-c ") and commands[2].endswith(f"{REPO}[dev]")
    assert "with torch==2.13.0+cpu" in "\n".join(lines)  # pip install -e is pinned to it
    assert not any(c.startswith(("torch==2.13.0 ", "torch>=")) for c in commands)


def test_gpu_machine_gets_the_default_cuda_build(tmp_path):
    commands = pip_commands(dry_run(fake_env(tmp_path, None, gpu=True)))
    assert commands[0] == "torch>=2.11,<2.14"
    assert not any("+cpu" in c or "download.pytorch.org" in c for c in commands)


@pytest.mark.parametrize("gpu", [False, True])
def test_fitting_torch_is_kept(tmp_path, gpu):
    lines = dry_run(fake_env(tmp_path, "2.11.0+cu130", gpu=gpu))
    assert "[install] keeping the installed torch 2.11.0+cu130 (fits [2.11, 2.16))" in lines
    commands = pip_commands(lines)
    assert len(commands) == 1 and commands[0].startswith("-c "), commands
    assert "with torch==2.11.0+cu130" in "\n".join(lines)


@pytest.mark.parametrize("torch_version,dist_version", [
    ("2.15.0+cu132", "2.15.0"),  # PyPI's wheel: torch says +cu132, pip knows 2.15.0
    ("2.14.1+cpu", None),
])
def test_newest_torch_is_kept_and_pinned_as_pip_names_it(tmp_path, torch_version, dist_version):
    lines = dry_run(fake_env(tmp_path, torch_version, gpu=False, dist_version=dist_version))
    pip_name = dist_version or torch_version
    assert f"[install] keeping the installed torch {pip_name} (fits [2.11, 2.16))" in lines
    assert f"with torch=={pip_name}" in "\n".join(lines)
    assert len(pip_commands(lines)) == 1


def test_torch_past_the_tested_range_is_replaced(tmp_path):
    commands = pip_commands(dry_run(fake_env(tmp_path, "2.16.0", gpu=False)))
    assert commands[0] == "torch==2.13.0+cpu"


def test_unknown_argument_is_an_error():
    result = subprocess.run(["bash", str(REPO / "scripts" / "install.sh"), "--gpu"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2 and "unknown argument '--gpu'" in result.stderr


def test_test_sh_passes_its_arguments_to_pytest(tmp_path):
    """scripts/test.sh tests/test_launch.py runs that file only; no arguments: all of tests/."""
    log = tmp_path / "pytest_args"
    python = tmp_path / "python"  # records pytest's arguments, runs anything else
    python.write_text(
        f'#!/bin/sh\nif [ "$1 $2" = "-m pytest" ]; then shift 2; echo "$*" >> {log}; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    env = {**os.environ, "PYTHON": str(python), "TIDE_INSTALL_DRY_RUN": "1"}
    for args in (["tests/test_launch.py", "-k", "help"], []):
        subprocess.run(["bash", str(REPO / "scripts" / "test.sh"), *args], env=env, timeout=60,
                       check=True, capture_output=True)
    assert log.read_text().splitlines() == ["-q tests/test_launch.py -k help", "-q tests"]
