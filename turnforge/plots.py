"""Figures on disk: matplotlib without a display, each figure laid out, saved and closed in one place."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def subplots(*args: Any, **kwargs: Any) -> Any:
    """``matplotlib.pyplot.subplots`` on the Agg backend (no display needed): ``(fig, axes)``.
    matplotlib is imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*args, **kwargs)


def save_figure(fig: Any, path: Path, dpi: int = 100) -> Path:
    """Lay ``fig`` out (``tight_layout``), write it to ``path`` and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path
