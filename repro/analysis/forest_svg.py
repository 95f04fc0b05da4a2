"""The report's forest plots as inline SVG text, the same bytes on every run.

One plot per column: each row's difference from the reference row (a summary ``Cell``): its 95%
interval as a bar, the mean over seeds as a dot (filled where the family's verdict rejects), each
seed's own difference as a cross; zero marked. matplotlib's SVG carries no date or version
(``metadata``), its text stays text (``svg.fonttype`` none: small, and no glyph definitions), its hashed
ids are salted per plot (``svg.hashsalt``) so that they do not change between runs, and every id and
reference to one is prefixed by the plot's name, so that two plots of one page never share an id.
"""

from __future__ import annotations

import io
import re

from repro.analysis.summary import Cell

ROW_INCHES = 0.3
WIDTH_INCHES = 4.2
SEED_COLOUR = "C1"
MEAN_COLOUR = "C0"


def forest_svg(title: str, xlabel: str, rows: list[str], cells: list[Cell | None], salt: str) -> str:
    """An ``<svg>`` element (no XML declaration) of ``rows``' ``cells``; a row without one reads "not computed"."""
    import matplotlib  # deferred: matplotlib is heavy; only the report needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # deferred, as above

    settings = {"svg.hashsalt": salt, "svg.fonttype": "none", "font.size": 8}
    with matplotlib.rc_context(settings):
        fig, ax = plt.subplots(figsize=(WIDTH_INCHES, ROW_INCHES * len(rows) + 0.9))
        for y, cell in enumerate(cells):
            if cell is None:
                ax.text(0.5, y, "not computed", transform=ax.get_yaxis_transform(), ha="center", va="center",
                        color="grey")
                continue
            if cell.interval is not None:
                ax.plot(list(cell.interval), [y, y], color=MEAN_COLOUR, lw=1.6, solid_capstyle="butt")
            if cell.per_seed:
                ax.plot(list(cell.per_seed), [y] * len(cell.per_seed), ls="none", marker="x", ms=4,
                        color=SEED_COLOUR, alpha=0.9)
            ax.plot([cell.mean], [y], ls="none", marker="o", ms=6, mec=MEAN_COLOUR,
                    mfc=MEAN_COLOUR if cell.mark == "†" else "white")
        ax.axvline(0, color="grey", lw=0.8, zorder=0)
        ax.set_yticks(range(len(rows)), rows)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_title(title)
        ax.set_xlabel(xlabel)
        ax.grid(axis="x", lw=0.3, alpha=0.5)
        fig.tight_layout()
        out = io.StringIO()
        fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
        plt.close(fig)
    text = out.getvalue()
    return re.sub(r'(\bid="|href="#|url\(#)', lambda m: f"{m.group(1)}{salt}-", text[text.index("<svg"):])
