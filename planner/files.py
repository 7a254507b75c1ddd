"""Writing outputs safely: every output of a command checked before any is written
(:func:`check_outputs`), and each written atomically (:func:`write_atomic`). Part of the
contract layer (plans, profiles, reports and programs are all written through it): it imports
nothing of ours but the errors.
"""
from __future__ import annotations

from planner.errors import PlanError


def check_outputs(paths: list[str], force: bool = False) -> None:
    """Refuse, before anything is written, every output of a command that ``write_atomic``
    would refuse or fail on: two outputs naming one file, a folder, an existing file without
    ``force``, a parent that is a file or a folder that cannot be written."""
    import os

    seen: set[str] = set()
    for path in paths:
        full = os.path.abspath(path)
        if full in seen:
            raise PlanError(f"two outputs name {path}: give each output its own path")
        seen.add(full)
        if os.path.isdir(path):
            raise PlanError(f"{path} is a folder: give a file path for the output")
        if os.path.exists(path) and not force:
            raise PlanError(f"{path} exists: pass --force to overwrite it, or choose another output path")
        folder = os.path.dirname(full)
        while not os.path.exists(folder):  # write_atomic makes the missing folders
            folder = os.path.dirname(folder)
        if not os.path.isdir(folder):
            raise PlanError(f"cannot write {path}: {folder} is a file, not a folder; choose another output path")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise PlanError(f"cannot write {path}: folder {folder} is not writable; choose a writable output path")


def write_atomic(path: str, text: str, force: bool = False) -> None:
    """Write ``text`` to ``path`` via a temporary file in the same folder and os.replace;
    an existing file is kept unless ``force``."""
    import os
    import tempfile

    if os.path.exists(path) and not force:
        raise PlanError(f"{path} exists: pass --force to overwrite it, or choose another output path")
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    except OSError as e:
        raise PlanError(f"cannot write {path}: {e.strerror}: choose a writable output path") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; plans and reports are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
