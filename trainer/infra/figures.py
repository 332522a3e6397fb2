"""PNG figures, drawn one way: a matplotlib `Figure` on its own Agg canvas, never pyplot (no global
figure state shared by the jobs of a multirun or by threads), written atomically. matplotlib is
imported on first use: most runs import the modules that can draw without drawing (about 0.5 s)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.infra.atomic import replace_atomic


def new_figure(**kwargs: Any) -> Any:
    """A `matplotlib.figure.Figure(**kwargs)` ready to draw on and save."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(**kwargs)
    FigureCanvasAgg(figure)
    return figure


def save_png(figure: Any, path: Path | str, dpi: int = 110) -> Path:
    """`figure` as a PNG at `path`, replaced atomically; the path."""
    path = Path(path)
    replace_atomic(path, lambda tmp: figure.savefig(tmp, format="png", dpi=dpi))
    return path
