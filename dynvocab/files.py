"""Writing output files safely: a temp file in the same folder, fsynced, then renamed over the target."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Callable


def chmod_like_new_file(path: str | Path) -> None:
    """Give a ``mkstemp`` file (created 0600) the permissions ``open()`` would: 0666 minus the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temp file in ``path``'s folder, then rename it over ``path``.

    A failure (or an interrupt) leaves ``path`` as it was and removes the temp file: never a half-written file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        chmod_like_new_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
