"""The HTML page of a plan report, read as markup (no browser; the browser test is
test_plan_html_browser.py): every column of the text and JSON reports, a raw number behind every
numeric cell, nothing loaded from outside the page."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from tpurec.data.catalog import TableSpec
from tpurec.planner import report as I
from tpurec.planner import report_html

TABLES = [
    TableSpec("t_big", "f_big", 2_000_000, 128, 3.0),
    TableSpec("t_half", "f_half", 50_000, 64, 1.0, data_type="fp16", extra_features=("f_half2",), pooling="mean"),
    TableSpec("t_small", "f_small", 100, 16, 1.0, weighted=True),
]


class _Tables(HTMLParser):
    """{table id: {"head": [(label, type)], "rows": [[(data-sort or None, text)]]}}."""

    def __init__(self):
        super().__init__()
        self.tables: dict[str, dict] = {}
        self._table = self._cell = None
        self._text = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "table":
            self._table = self.tables.setdefault(a["id"], {"head": [], "rows": []})
        elif self._table is not None and tag == "tr":
            self._row = []
        elif self._table is not None and tag in ("td", "th"):
            self._cell, self._text = a, ""

    def handle_data(self, data):
        if self._cell is not None:
            self._text += data

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            if tag == "th":
                self._table["head"].append((self._text, self._cell.get("data-type")))
            else:
                self._row.append((self._cell.get("data-sort"), self._text))
            self._cell = None
        elif tag == "tr" and self._table is not None and self._row:
            self._table["rows"].append(self._row)
        elif tag == "table":
            self._table = None


@pytest.fixture(scope="module")
def report():
    return I.plan_tables(TABLES, "v5p-8", batch_size=64, optimizer="adam", model="three")


def _parse(page: str) -> dict:
    p = _Tables()
    p.feed(page)
    return p.tables


def test_every_column_and_a_number_behind_every_numeric_cell(report):
    page = report_html.html_page(report)
    tables = _parse(page)
    assert set(tables) == {"tables", "devices", "slowest", "shards"}
    for table_id, t in tables.items():
        assert t["rows"], table_id
        for row in t["rows"]:
            assert len(row) == len(t["head"]), table_id
            for (label, kind), (raw, _) in zip(t["head"], row):
                assert (raw is not None) == (kind == "num"), (table_id, label)
                if raw is not None:
                    float(raw)  # a plain number the page's script can compare
    heads = {k: [label for label, _ in t["head"]] for k, t in tables.items()}
    # the text report's table columns and the JSON report's per-table fields
    assert heads["tables"] == [
        "name", "module", "rows", "dim", "pool", "features", "pooling", "weighted", "data type",
        "stored as", "sharding", "kernel", "ranks", "shards", "memory", "ms",
    ]  # fmt: skip
    # the text report's device columns (time, lookup, update, comm per step) and top tables
    assert heads["devices"][:2] == ["devs", "ranks"] and heads["devices"][-1] == "top tables"
    for label in ("used", "cap", "%", "weights", "optim", "buffers", "activ", "transient", "reserved", "time"):
        assert label in heads["devices"]
    by_name = {row[0][1]: row for row in tables["tables"]["rows"]}
    col = heads["tables"].index
    assert by_name["t_half"][col("features")][1] == "f_half, f_half2" and by_name["t_half"][col("pooling")][1] == "mean"
    assert by_name["t_half"][col("stored as")][1] == "fp32"  # widened on a TPU, and said why under Notes
    assert "<h2>Notes</h2>" in page and "fp16 stored as fp32" in page
    assert by_name["t_small"][col("weighted")][1] == "yes"
    assert int(by_name["t_big"][col("rows")][0]) == 2_000_000 and by_name["t_big"][col("rows")][1] == "2,000,000"
    big = next(t for t in report["tables"] if t["name"] == "t_big")
    assert int(by_name["t_big"][col("memory")][0]) == big["bytes"]  # raw bytes behind the scaled unit
    assert len(tables["shards"]["rows"]) == sum(len(t["shards"]) for t in report["tables"])


def test_nothing_loaded_from_outside(report):
    page = report_html.html_page(report)
    refs = re.findall(r'(?:src|href)="([^"]*)"', page)
    assert refs and all(r.startswith("data:") for r in refs)
    assert "Content-Security-Policy" in page and "default-src 'none'" in page


def test_refused_report_names_the_reason_and_the_fitting_slices(report):
    refused = dict(report, fits=False, refusal="too big <for> v5p-8", smallest_fitting_topology={"v5p": "v5p-16"})
    page = report_html.html_page(refused)
    assert "does NOT fit" in page and "too big &lt;for&gt; v5p-8" in page and "v5p-16" in page


class _Markup(HTMLParser):
    """Every start tag and all text of a page."""

    def __init__(self):
        super().__init__()
        self.tags: list[str] = []
        self.text = ""

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)

    def handle_data(self, data):
        self.text += data


def test_names_that_look_like_markup_render_as_text():
    """Table, feature and model names come from user files (`plan --tables`, a model module): a
    table named `<script>` must be text on the page, never an element; a quote or an ampersand
    must not end an attribute or start an entity."""
    evil = "<script>alert(1)</script>"
    tables = [
        TableSpec(evil, '<img src=x onerror="alert(2)">', 1000, 16, 1.0),
        TableSpec('a&b"c', "f", 10, 8, 1.0),
    ]
    page = report_html.html_page(I.plan_tables(tables, "v5p-8", batch_size=64, optimizer="sgd", model="<i>m</i>"))
    markup = _Markup()
    markup.feed(page)
    assert markup.tags.count("script") == 1 and "img" in markup.tags  # the page's own script and PNG only
    assert sum(1 for t in markup.tags if t == "img") == 1 and "i" not in markup.tags
    assert evil in markup.text and 'a&b"c' in markup.text and "<i>m</i>" in markup.text
    names = [row[0][1] for row in _parse(page)["tables"]["rows"]]
    assert sorted(names) == sorted([evil, 'a&b"c'])
    shards = {row[0][1] for row in _parse(page)["shards"]["rows"]}
    assert shards == {evil, 'a&b"c'}
