"""Where specdec lives on disk: the installed package and, when it runs from one, the source checkout."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def source_checkout() -> Path | None:
    """The repository root when specdec is imported from a source checkout (an editable install), else None."""
    root = PACKAGE_DIR.parent
    if (root / "setup.py").is_file() or (root / "pyproject.toml").is_file():
        return root
    return None


BUILTIN_DATA_DIR = PACKAGE_DIR / "datasets"
"""The evaluation data shipped inside the package (one folder per data set, each with its license)."""


def current_umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: str | os.PathLike, since: float | None = None) -> None:
    """Give ``path`` (a file, or a folder and everything in it) the permissions a new file or folder gets under the
    umask: safetensors (``save_file``, hence ``save_pretrained``) and ``tempfile`` make theirs 0600 / 0700, which
    other users (a shared cache, a serving account) cannot read. With ``since`` (a ``time.time()``), only entries
    modified since then, i.e. written by the caller, are changed."""
    mask = current_umask()
    path = Path(path)
    entries = [path, *path.rglob("*")] if path.is_dir() else [path]
    for entry in entries:
        if entry.is_symlink() or (since is not None and entry.stat().st_mtime < since):
            continue
        os.chmod(entry, (0o777 if entry.is_dir() else 0o666) & ~mask)
