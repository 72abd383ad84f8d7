"""A plan report (inspect.build_report) as one self-contained HTML page with sortable tables.

Every column of the text report and every per-table and per-shard field of the JSON report is a
table column. Clicking a column header sorts its table (again: the other way). Numeric cells carry
their raw number in `data-sort`, so "1.50 GiB" sorts above "900.00 MiB" whatever the shown unit;
text cells sort with numbers inside them compared as numbers (t_C2 before t_C10). CSS, script and
the PNG are inline and a Content-Security-Policy forbids anything else: the page works offline, from
a file or an e-mail attachment, and loads nothing from the network.
"""

from __future__ import annotations

import html
from typing import Any, Callable, Iterable, NamedTuple

from tpurec.planner.report_png import png_bytes
from tpurec.planner.report_text import (
    device_cells,
    device_groups,
    fitting_text,
    format_text,
    hot_devices,
    kernel_assumption,
    rank_ranges,
    ranks_in_order,
)
from tpurec.planner.topology import format_bytes

# Inline style and script only; img-src data: is the embedded PNG.
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"

_STYLE = """body{font-family:sans-serif;margin:2em}
table{border-collapse:collapse}
.wide{overflow-x:auto;max-width:100%;margin-bottom:1.5em}
td,th{border:1px solid #ccc;padding:2px 8px;text-align:right;white-space:nowrap}
td.text,th.text{text-align:left}
th{background:#eee;cursor:pointer;user-select:none}
th[aria-sort=ascending]::after{content:" \\25b2"}
th[aria-sort=descending]::after{content:" \\25bc"}
pre{background:#f6f6f6;padding:1em;overflow:auto}
.refused{color:#b00}"""

# Sorting: ascending on the first click, descending on the next. Array.prototype.sort is stable,
# so rows with equal keys keep their previous order.
_SCRIPT = """(function () {
  "use strict";
  var collator = new Intl.Collator(undefined, {numeric: true, sensitivity: "base"});
  function sortBy(table, th, col) {
    var ascending = th.getAttribute("aria-sort") !== "ascending";
    var numeric = th.dataset.type === "num";
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = a.cells[col], y = b.cells[col];
      var c = numeric ? Number(x.dataset.sort) - Number(y.dataset.sort)
                      : collator.compare(x.textContent, y.textContent);
      return ascending ? c : -c;
    });
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (h) { h.removeAttribute("aria-sort"); });
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    rows.forEach(function (r) { body.appendChild(r); });
  }
  Array.prototype.forEach.call(document.querySelectorAll("table.sortable"), function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, col) {
      th.tabIndex = 0;
      th.addEventListener("click", function () { sortBy(table, th, col); });
      th.addEventListener("keydown", function (e) {
        if (e.key === "Enter" || e.key === " ") { e.preventDefault(); sortBy(table, th, col); }
      });
    });
  });
})();"""


class Column(NamedTuple):
    label: str
    numeric: bool
    cell: Callable[[Any], tuple]  # row (a report's JSON dict or pair) -> (raw number or None, shown text)
    title: str = ""


def _num(value: float, shown: str | None = None) -> tuple:
    return value, f"{value:,}" if shown is None else shown


def _txt(shown: object) -> tuple:
    return None, str(shown)


def _ms(value: float) -> tuple:
    return value, f"{value:.3f}"


def _bytes(value: int) -> tuple:
    return value, format_bytes(value)


def _table(table_id: str, columns: list[Column], rows: Iterable[Any]) -> str:
    head = "".join(
        f'<th class="{"num" if c.numeric else "text"}" data-type="{"num" if c.numeric else "text"}"'
        + (f' title="{html.escape(c.title)}"' if c.title else "")
        + f">{html.escape(c.label)}</th>"
        for c in columns
    )
    body = []
    for row in rows:
        cells = []
        for c in columns:
            raw, shown = c.cell(row)
            if c.numeric:
                cells.append(f'<td class="num" data-sort="{raw!r}">{html.escape(shown)}</td>')
            else:
                cells.append(f'<td class="text">{html.escape(shown)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    # In a box of its own that scrolls sideways: a wide table never makes the page wider than the window.
    return (
        f'<div class="wide"><table class="sortable" id="{table_id}"><thead><tr>{head}</tr></thead>'
        f"<tbody>\n" + "\n".join(body) + "\n</tbody></table></div>"
    )


_TABLE_COLUMNS = [
    Column("name", False, lambda t: _txt(t["name"])),
    Column("module", False, lambda t: _txt(t["module"] or "(top level)"), "module path of its collection in the plan"),
    Column("rows", True, lambda t: _num(t["rows"]), "logical rows, before padding"),
    Column("dim", True, lambda t: _num(t["dim"])),
    Column("pool", True, lambda t: _num(t["pooling_factor"], f"{t['pooling_factor']:g}"), "mean ids per sample"),
    Column("features", False, lambda t: _txt(", ".join(t["features"]))),
    Column("pooling", False, lambda t: _txt(t["pooling"])),
    Column("weighted", False, lambda t: _txt("yes" if t["weighted"] else "no")),
    Column("data type", False, lambda t: _txt(t["data_type"])),
    Column("stored as", False, lambda t: _txt(t["stored_as"])),
    Column("sharding", False, lambda t: _txt(t["sharding_type"])),
    Column("kernel", False, lambda t: _txt(t["compute_kernel"])),
    # shown in shard order (the row order of the shards), sorted by the lowest rank
    Column("ranks", True, lambda t: (min(t["ranks"]), ranks_in_order(t["ranks"])), "in shard order"),
    Column("shards", True, lambda t: _num(len(t["shards"]))),
    Column("memory", True, lambda t: _bytes(t["bytes"]), "all shards"),
    Column("ms", True, lambda t: _ms(t["time_ms"]), "summed over the shards"),
]


def _top(d: dict) -> str:
    return ", ".join(f"{t['name']} {t['time_ms']:.3f} ms" for t in d.get("top_tables", [])) or "no tables"


# rows: (ranks, one device); devices in a row have the same figures and top tables
_DEVICE_COLUMNS = [
    Column("devs", True, lambda g: _num(len(g[0]))),
    Column("ranks", True, lambda g: (g[0][0], rank_ranges(g[0], most=len(g[0]))), "sorted by the lowest"),
    Column("used", True, lambda g: _bytes(g[1]["hbm_used_bytes"])),
    Column("cap", True, lambda g: _bytes(g[1]["hbm_capacity_bytes"])),
    Column("%", True, lambda g: _pct(g[1]), "of capacity"),
    Column("weights", True, lambda g: _bytes(g[1].get("weights_bytes", 0))),
    Column("optim", True, lambda g: _bytes(g[1].get("optimizer_bytes", 0))),
    Column("buffers", True, lambda g: _bytes(g[1].get("buffers_bytes", 0)), "SparseCore buffers"),
    Column("activ", True, lambda g: _bytes(g[1].get("activations_bytes", 0)), "pooled activations and grads"),
    Column("transient", True, lambda g: _bytes(g[1].get("transient_bytes", 0)), "the update's new table+state"),
    Column("reserved", True, lambda g: _bytes(g[1].get("reserved_bytes", 0)), "dense model, headroom"),
    Column("time", True, lambda g: _ms(g[1]["estimated_time_ms"]), "ms per step"),
    Column("lookup", True, lambda g: _ms(g[1]["lookup_ms"])),
    Column("update", True, lambda g: _ms(g[1]["update_ms"])),
    Column("comm", True, lambda g: _ms(g[1]["comm_ms"])),
    Column("top tables", False, lambda g: _txt(_top(g[1])), "the tables whose shards take the most time there"),
]


def _pct(d: dict) -> tuple:
    pct = 100 * d["hbm_used_bytes"] / d["hbm_capacity_bytes"]
    return pct, f"{pct:.1f}"


_HOT_COLUMNS = [
    Column("ranks", True, lambda g: (g[0][0], rank_ranges(g[0], most=len(g[0])))),
    Column("ms", True, lambda g: _ms(g[1]["estimated_time_ms"])),
    Column("tables that take its time", False, lambda g: _txt(_top(g[1]))),
]

# rows: (table name, shard)
_SHARD_COLUMNS = [
    Column("table", False, lambda ts: _txt(ts[0])),
    Column("rank", True, lambda ts: _num(ts[1]["rank"])),
    Column("row offset", True, lambda ts: _num(ts[1]["offsets"][0])),
    Column("col offset", True, lambda ts: _num(ts[1]["offsets"][1])),
    Column("rows", True, lambda ts: _num(ts[1]["sizes"][0])),
    Column("cols", True, lambda ts: _num(ts[1]["sizes"][1])),
    Column("memory", True, lambda ts: _bytes(ts[1]["bytes"])),
    Column("ms", True, lambda ts: _ms(ts[1]["time_ms"])),
]


def _summary(report: dict) -> str:
    a = report["assumptions"]
    cap = report["devices"][0]["hbm_capacity_bytes"]
    lines = [
        f"{report['world_size']} devices of {format_bytes(cap)}, batch {report['batch_size_per_device']}/device, "
        f"optimizer {report['optimizer']}; estimated embedding step time "
        f"<b>{report['estimated_step_time_ms']:.3f} ms</b>; imbalance (max/mean) time "
        f"{report['time_imbalance']:.2f}, HBM {report['hbm_imbalance']:.2f}.",
        f"Assumptions: {kernel_assumption(a)}, all-to-all efficiency {a['all_to_all_efficiency']}, "
        f"DCN {a['dcn_bw_per_host_bytes_per_s'] / 1e9:.0f} GB/s per host, headroom {a['headroom_fraction']:.0%}.",
    ]
    if report.get("refusal"):
        lines += [
            f'<span class="refused">Refused: {html.escape(report["refusal"])}</span>',
            f"Smallest fitting slice: {html.escape(fitting_text(report))}.",
        ]
    return "".join(f"<p>{line}</p>" for line in lines)


def html_page(report: dict) -> str:
    import base64

    img = base64.b64encode(png_bytes(report)).decode()
    tables = sorted(report["tables"], key=lambda t: -t["bytes"])  # largest first, as the text report
    groups = device_groups(report["devices"], key=lambda d: (device_cells(d), _top(d)))
    shards = [(t["name"], s) for t in tables for s in t["shards"]]
    notes = "".join(f"<li>{html.escape(t['name'])}: {html.escape(t['note'])}</li>" for t in tables if t.get("note"))
    title = f"{report.get('model') or 'tables'} on {report['topology']}"
    status = "fits" if report["fits"] else "does NOT fit"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<link rel="icon" href="data:,">
<title>tpurec plan: {html.escape(title)}</title>
<style>{_STYLE}</style></head><body>
<h1>{html.escape(title)}: {status}</h1>
{_summary(report)}
<img alt="per-device HBM and time" src="data:image/png;base64,{img}" style="max-width:100%">
<p>Click a column header to sort its table; click again to reverse.</p>
<h2>Tables ({len(tables)})</h2>
{_table("tables", _TABLE_COLUMNS, tables)}
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
<h2>Devices ({report["world_size"]}; identical devices share a row)</h2>
{_table("devices", _DEVICE_COLUMNS, groups)}
<h2>Slowest devices and the tables that take their time</h2>
{_table("slowest", _HOT_COLUMNS, hot_devices(report["devices"]))}
<h2>Shards ({len(shards)})</h2>
{_table("shards", _SHARD_COLUMNS, shards)}
<details><summary>Full text report</summary><pre>{html.escape(format_text(report))}</pre></details>
<script>{_SCRIPT}</script>
</body></html>
"""
