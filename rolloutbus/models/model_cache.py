"""Model folders written once into the cache (``~/.cache/rolloutbus``), safely shared.

Several processes may build the same folder at once (a replica and the workers, two test
runs): each writes into its own staging folder beside the target, and one rename publishes
it whole. A reader never sees a half-written folder; a process that loses the race keeps
the winner's copy, which is as good as its own.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exported_folder(folder: Path) -> Iterator[Path]:
    """Yield a staging folder to write into; on success it becomes ``folder``."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".tmp-", dir=folder.parent))
    try:
        yield staging
        try:
            os.rename(staging, folder)
        except OSError:
            # another process finished the same export first; its copy is as good as ours
            if not (folder / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
