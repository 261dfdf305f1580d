"""Writing output files safely: a temp file in the same folder, fsynced, then renamed over the target.

Every file dynvocab writes goes through :func:`write_atomic` (a folder through :func:`publish_dir`), so a reader
sees the old file or the new one, never half of one, even when the writer is killed with SIGKILL. A killed
writer leaves its temp file behind; the next write to the same path removes the temp files of writers that are
no longer alive (their process id is in the name).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def chmod_like_new_file(path: str | Path) -> None:
    """Give a ``mkstemp`` file (created 0600) the permissions ``open()`` would: 0666 minus the umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _temp_prefix(path: Path) -> str:
    return f".{path.name}.tmp-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temps(path: str | Path) -> None:
    """Delete temp files (or folders) left beside ``path`` by writers that were killed (their pid is gone)."""
    path = Path(path)
    prefix = _temp_prefix(path)
    if not path.parent.is_dir():
        return
    for leftover in path.parent.iterdir():
        if not leftover.name.startswith(prefix):
            continue
        pid = leftover.name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def fsync_dir(folder: str | Path) -> None:
    """Make a rename inside ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp)`` on a temp file in ``path``'s folder, then rename it over ``path``.

    A failure (or an interrupt) leaves ``path`` as it was and removes the temp file: never a half-written file.
    """
    path = Path(path)
    remove_stale_temps(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f"{_temp_prefix(path)}{os.getpid()}.", suffix=path.suffix or ".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        chmod_like_new_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def temp_dir_for(path: str | Path) -> Path:
    """A new empty folder beside ``path`` to stage a folder in before :func:`publish_dir` (stale ones removed)."""
    path = Path(path)
    remove_stale_temps(path)
    return Path(tempfile.mkdtemp(dir=path.parent, prefix=f"{_temp_prefix(path)}{os.getpid()}."))


def publish_dir(staged: Path, final: Path) -> Path:
    """Move the whole folder ``staged`` to ``final`` in one rename (``final`` must not exist)."""
    for item in staged.rglob("*"):
        if item.is_file():
            with open(item, "rb") as f:
                os.fsync(f.fileno())
    os.rename(staged, final)
    fsync_dir(final.parent)
    return final


@contextlib.contextmanager
def file_lock(path: str | Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock on ``path`` (created if needed) while the block runs; the kernel drops it
    when the process dies, so a killed holder never blocks the next one."""
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
