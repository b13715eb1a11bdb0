"""``ops/install.sh`` on a disk too small for a fresh ``.venv``: it stops before pip, says how
much it needs and has, and leaves no half-made venv (a CI run once failed 44 s in with pip's
"No space left on device")."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_install_on_a_full_disk_stops_before_pip_and_names_the_shortfall(tmp_path: Path) -> None:
    (tmp_path / "ops").mkdir()
    shutil.copy(REPO / "ops" / "install.sh", tmp_path / "ops" / "install.sh")
    need_gib = 10**9  # more than any disk: the check must fire
    done = subprocess.run(
        ["bash", str(tmp_path / "ops" / "install.sh")],
        env={"PATH": "/usr/local/bin:/usr/bin:/bin", "ROLLOUTBUS_INSTALL_NEED_GIB": str(need_gib)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    said = re.search(
        r"needs about (\d+) GiB free on the disk of (\S+); it has (\d+) GiB", done.stderr
    )
    assert said, done.stderr
    assert int(said[1]) == need_gib and Path(said[2]) == tmp_path
    free_gib = shutil.disk_usage(tmp_path).free // 2**30
    assert abs(int(said[3]) - free_gib) <= 1  # the figure is the disk's, not a parse gone wrong
    assert not (tmp_path / ".venv").exists()
