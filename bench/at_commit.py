"""Run a bench script against an older commit's kvmesh, in this checkout's venv: how the
benches compare old and new code in one session.

`git archive COMMIT` is unpacked into a temporary directory laid out as the `kvmesh` package
(`kvmesh/__init__.py`, and `workers`, `connector`, `cluster` under it, as pyproject maps
them); the editable install's finder is dropped from `sys.meta_path` so that copy is what
`import kvmesh` finds; then SCRIPT (a path in this checkout) runs with the remaining
arguments. The directory is removed afterwards. In-process benches only: Ray workers started
by the script would import this checkout's kvmesh.

    .venv/bin/python bench/at_commit.py 9134c28 bench/decode_context.py [args...]
"""

from __future__ import annotations

import io
import runpy
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGES = ("workers", "connector", "cluster")


def unpack(commit: str, root: Path) -> Path:
    """The commit's package under root/pkg/kvmesh; returns root/pkg."""
    tar = subprocess.run(["git", "archive", commit], check=True, capture_output=True).stdout
    src = root / "src"
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(src, filter="data")
    pkg = root / "pkg" / "kvmesh"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_bytes((src / "kvmesh" / "__init__.py").read_bytes())
    for name in PACKAGES:
        (pkg / name).symlink_to(src / name, target_is_directory=True)
    return root / "pkg"


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    commit, script, *args = sys.argv[1:]
    with tempfile.TemporaryDirectory(prefix="kvmesh-at-") as tmp:
        sys.path.insert(0, str(unpack(commit, Path(tmp))))
        sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in repr(f).lower()]
        sys.argv = [script, *args]
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
