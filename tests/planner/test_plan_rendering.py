"""The plan's PNG and HTML as a reader sees them: the verdict in the picture's title whatever the
model name, the top-level module named in words."""

from __future__ import annotations

import pytest

from tpurec.data.catalog import get_table_set
from tpurec.planner import report as I
from tpurec.planner import report_html, report_png

LONG_PATH = "/home/someone/projects/recommendation/configs/experiments/2026/tables_for_the_big_ranking_model.yaml"


@pytest.fixture(scope="module")
def report():
    tables = list(get_table_set("dlrm-tiny").tables)
    return I.plan_tables(tables, "v6e-8", batch_size=512, optimizer="rowwise_adagrad", model=LONG_PATH)


def test_the_png_title_keeps_the_verdict_inside_the_picture(report):
    import matplotlib.pyplot as plt

    fig = report_png.figure(report)
    try:
        fig.canvas.draw()
        title = fig.axes[0].title
        box = title.get_window_extent(fig.canvas.get_renderer())
        assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height, (box, fig.bbox)
        text = title.get_text()
        assert text.startswith("fits: tables_for_the_big_ranking_model.yaml on v6e-8")
    finally:
        plt.close(fig)


def test_short_names_keep_both_ends():
    assert report_png.short_name("a/b/c.yaml", 8) == "c.yaml"
    assert report_png.short_name("x" * 10 + "y" * 10, 11) == "xxxx...yyyy"  # 11 characters
    assert report_png.short_name("dlrm-tiny", 40) == "dlrm-tiny"


def test_the_html_names_the_top_level_module_in_words(report):
    assert {t["module"] for t in report["tables"]} == {""}  # one collection at the model's top
    page = report_html.html_page(report)
    assert '<td class="text">(top level)</td>' in page and '<td class="text">""</td>' not in page
