"""The HTML report of real plans in a real headless Chromium: it loads without console errors or
network requests, shows every table and every device (or device group), and its column headers
sort the rows, numbers by value whatever their unit.

Skipped where no browser is installed (`apt-get install chromium`; CI installs it, see .ci/run).
The browser is driven over the DevTools protocol on a pipe (tests/headless_chromium.py).
"""

from __future__ import annotations

import re

import pytest

from tests.headless_chromium import INSTALL_HINT, Chromium, find_browser
from tpurec.data.catalog import get_table_set
from tpurec.planner import report as I
from tpurec.planner import report_html

pytestmark = pytest.mark.timeout(180)  # every browser wait is bounded too (20 s each)

# Two real plans: a host of 8 devices, and 64 devices whose alike devices share rows.
PLANS = {"dlrm-tiny@v6e-8": ("dlrm-tiny", "v6e-8"), "criteo-kaggle@v5p-128": ("criteo-kaggle", "v5p-128")}


@pytest.fixture(scope="module")
def browser():
    exe = find_browser()
    if exe is None:
        pytest.skip(INSTALL_HINT)
    b = Chromium(exe)
    yield b
    b.close()


@pytest.fixture(scope="module", params=list(PLANS))
def page(request, tmp_path_factory):
    """(report, file URL of its HTML page)."""
    model, topology = PLANS[request.param]
    tables = list(get_table_set(model).tables)
    report = I.plan_tables(tables, topology, batch_size=512, optimizer="rowwise_adagrad", model=model)
    path = tmp_path_factory.mktemp("html") / "plan.html"
    path.write_text(report_html.html_page(report))
    return report, path.as_uri()


def _column(b: Chromium, table: str, col: int, attr: str | None = None) -> list:
    """The cells of column `col` (0-based) of table `#table`, in the order the page shows them."""
    value = f"c.dataset.{attr}" if attr else "c.textContent"
    return b.evaluate(
        f"Array.from(document.querySelectorAll('#{table} tbody tr'))"
        f".map(function (r) {{ var c = r.cells[{col}]; return {value}; }})"
    )


def _header_index(b: Chromium, table: str, label: str) -> int:
    labels = b.evaluate(f"Array.from(document.querySelectorAll('#{table} thead th')).map(h => h.textContent)")
    return labels.index(label)


def _sort(b: Chromium, table: str, label: str) -> str:
    """Click the header `label` of `#table`; return its aria-sort once the click has sorted."""
    col = _header_index(b, table, label)
    before = b.evaluate(f"document.querySelectorAll('#{table} thead th')[{col}].getAttribute('aria-sort')")
    b.click(f"#{table} thead th:nth-child({col + 1})")
    after = b.evaluate(f"document.querySelectorAll('#{table} thead th')[{col}].getAttribute('aria-sort')")
    assert after != before, f"clicking {label!r} of #{table} did not sort it"
    return after


def _expand(ranks_text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (report_text.rank_ranges, nothing elided)."""
    out: list[int] = []
    for part in ranks_text.split(","):
        a, _, b = part.partition("-")
        out += range(int(a), int(b or a) + 1)
    return out


def _natural(name: str) -> list:
    """The order of Intl.Collator(numeric) on these names: digit runs compared as numbers."""
    return [(0, int(s)) if s.isdigit() else (1, s.lower()) for s in re.split(r"(\d+)", name) if s]


def test_console_errors_are_caught(browser):
    # The check the other tests rely on: an exception, console.error and a refused network load
    # (what the page's policy would report) all register as errors.
    script = "<script>console.error('boom'); throw new Error('bad')</script><img src='http://127.0.0.1:9/x.png'>"
    browser.open("data:text/html," + script)
    browser.evaluate("1")  # a round trip, so the events before it have arrived
    found = " ".join(browser.console_errors)
    assert "boom" in found and "Error: bad" in found and "127.0.0.1:9/x.png" in found


def test_loads_clean_and_shows_every_table_and_device(browser, page):
    report, url = page
    browser.open(url)
    assert browser.evaluate("document.readyState") == "complete"
    # nothing fetched but the page itself (the picture is a data: URI)
    assert browser.evaluate("performance.getEntriesByType('resource').map(e => e.name)") == []
    names = _column(browser, "tables", 0)
    assert sorted(names) == sorted(t["name"] for t in report["tables"])
    heights = browser.evaluate("Array.from(document.querySelectorAll('#tables tbody tr')).map(r => r.offsetHeight)")
    assert min(heights) > 0  # laid out, not hidden
    # every device exactly once across the device rows, and the row counts add up
    ranks = [_expand(t) for t in _column(browser, "devices", _header_index(browser, "devices", "ranks"))]
    flat = [r for group in ranks for r in group]
    assert sorted(flat) == list(range(report["world_size"]))
    assert [int(n) for n in _column(browser, "devices", 0)] == [len(g) for g in ranks]
    assert browser.evaluate("document.querySelector('img').naturalWidth") > 0  # the PNG decoded
    shards = _column(browser, "shards", 0)
    assert len(shards) == sum(len(t["shards"]) for t in report["tables"])
    assert browser.console_errors == []


def test_headers_sort_numbers_by_value_and_text_naturally(browser, page):
    report, url = page
    browser.open(url)
    size = {t["name"]: t["bytes"] for t in report["tables"]}
    memory = _header_index(browser, "tables", "memory")
    units = {cell.split()[-1] for cell in _column(browser, "tables", memory)}
    assert len(units) > 1, f"every table shows {units}: this plan cannot check unit-aware sorting"

    assert _sort(browser, "tables", "memory") == "ascending"
    shown = [size[n] for n in _column(browser, "tables", 0)]
    assert shown == sorted(shown)
    assert _sort(browser, "tables", "memory") == "descending"
    shown = [size[n] for n in _column(browser, "tables", 0)]
    assert shown == sorted(shown, reverse=True)

    assert _sort(browser, "tables", "name") == "ascending"
    names = _column(browser, "tables", 0)
    assert names == sorted(names, key=_natural) and names != sorted(names)  # t_C2 before t_C10
    assert _sort(browser, "tables", "name") == "descending"
    assert _column(browser, "tables", 0) == sorted(names, key=_natural, reverse=True)

    # another table on the same page sorts on its own
    time_col = _header_index(browser, "devices", "time")
    assert _sort(browser, "devices", "time") == "ascending"
    times = [float(x) for x in _column(browser, "devices", time_col, attr="sort")]
    assert times == sorted(times)
    assert browser.evaluate("document.querySelector('#tables thead th[aria-sort]').textContent") == "name"
    assert browser.console_errors == []


def test_fits_a_1400_pixel_window(browser, page):
    # Wide tables scroll inside their own box; the page itself is never wider than the window.
    report, url = page
    browser.call(
        "Emulation.setDeviceMetricsOverride",
        {"width": 1400, "height": 900, "deviceScaleFactor": 1, "mobile": False},
        session=True,
    )
    try:
        browser.open(url)
        assert browser.evaluate("document.documentElement.scrollWidth") <= 1400
        assert browser.evaluate("document.body.scrollWidth") <= 1400
        # every table is still reachable: its box scrolls sideways where the table is wider
        boxes = browser.evaluate(
            "Array.from(document.querySelectorAll('table.sortable')).map(t => "
            "[t.parentElement.className, t.parentElement.clientWidth, getComputedStyle(t.parentElement).overflowX])"
        )
        assert boxes and all(b[0] == "wide" and b[1] <= 1400 and b[2] == "auto" for b in boxes), boxes
    finally:
        browser.call("Emulation.clearDeviceMetricsOverride", {}, session=True)
