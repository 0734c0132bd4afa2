"""Where specdec lives on disk: the installed package and, when it runs from one, the source checkout."""

from __future__ import annotations

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
