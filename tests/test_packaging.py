"""The three code folders install as kvmesh.* and nothing generic lands in site-packages."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, kvmesh, kvmesh.workers.block_pool, kvmesh.connector, kvmesh.cluster\n"
    "print(kvmesh.__version__, kvmesh.workers.block_pool.__file__)\n"
    "print([n for n in ('workers', 'connector', 'cluster') if importlib.util.find_spec(n)])\n"
)


def run_probe(cwd: Path, extra_path: str | None = None) -> list[str]:
    env = dict(os.environ)
    if extra_path:
        env["PYTHONPATH"] = extra_path
    out = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def test_editable_install_maps_the_folders(tmp_path: Path) -> None:
    version_and_file, generic = run_probe(tmp_path)
    assert version_and_file.split()[1] == str(REPO / "workers" / "block_pool.py")
    assert generic == "[]"


@pytest.mark.slow
def test_built_wheel_holds_only_kvmesh(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("kvmesh-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.startswith("kvmesh-")}
    assert tops == {"kvmesh"}
    kernels = ("workers/csrc/qmatmul.c", "workers/csrc/paged_attention.c")
    for module in ("workers/block_pool.py", "connector/__init__.py", "cluster/cli.py", *kernels):
        assert f"kvmesh/{module}" in names
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    assert not any((target / n).exists() for n in ("workers", "connector", "cluster"))
    version_and_file, generic = run_probe(tmp_path, extra_path=str(target))
    assert version_and_file.split()[1] == str(target / "kvmesh" / "workers" / "block_pool.py")
    assert generic == "[]"
