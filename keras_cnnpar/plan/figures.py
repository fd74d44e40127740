"""Plots drawn off-screen and written beside their tables, both or neither.

>>> pyplot().get_backend().lower()
'agg'
"""

from pathlib import Path

from keras_cnnpar.results import runs
from keras_cnnpar.runtime.atomic import write_together


def pyplot():
    """matplotlib's ``pyplot`` on the off-screen Agg backend, so no display is needed."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as loaded

    return loaded


def write_table_and_figure(folder, name, columns, rows, figure):
    """Write ``name.csv`` (the dicts ``rows`` under ``columns``) and ``name.png`` (``figure``) into ``folder``, both
    or neither (:func:`atomic.write_together`); the figure is closed either way."""
    folder = Path(folder)
    try:
        write_together({folder / f"{name}.csv": runs.csv_text(columns, rows),
                        folder / f"{name}.png": lambda partial: figure.savefig(partial, dpi=100, format="png")})
    finally:
        pyplot().close(figure)
