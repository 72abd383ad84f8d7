"""The PNG picture of a plan report: per-device stacked HBM bars over per-device time bars
(report_html embeds it in the HTML page)."""

from __future__ import annotations

import io
from typing import TYPE_CHECKING

from tpurec.planner.topology import GiB

if TYPE_CHECKING:
    from matplotlib.figure import Figure

_HBM_PARTS = (
    ("weights_bytes", "table weights"),
    ("optimizer_bytes", "optimizer state"),
    ("buffers_bytes", "SparseCore buffers"),
    ("activations_bytes", "pooled activations+grads"),
    ("transient_bytes", "update's new table+state (TPU)"),
    ("reserved_bytes", "reserved (dense, headroom)"),
)
_TIME_PARTS = (("lookup_ms", "SparseCore lookup"), ("update_ms", "fused update"), ("comm_ms", "communication"))


def hot_device_labels(report: dict) -> dict[int, str]:
    """{rank: 't_C21\nt_C20'} for the slowest kinds of device (report_text.hot_devices, the devices
    the text report names): the tables that take their time, drawn above the first such device's
    time bar."""
    from tpurec.planner.report_text import hot_devices

    return {
        ranks[0]: "\n".join(t["name"] for t in d["top_tables"])
        for ranks, d in hot_devices(report["devices"])
        if d.get("top_tables")
    }


def short_name(name: str, limit: int) -> str:
    """`name` in at most `limit` characters: a path by its file name, then the middle elided."""
    if len(name) > limit and "/" in name:
        name = name.rstrip("/").rsplit("/", 1)[-1]
    if len(name) <= limit:
        return name
    keep = max(1, limit - 3)
    return name[: keep - keep // 2] + "..." + name[len(name) - keep // 2 :]


def title(report: dict, width_inches: float) -> str:
    """The verdict first, then what was planned; lines no wider than the figure (at 10 pt, about 12
    characters per inch), so a long model name or --tables path never pushes the verdict out."""
    import textwrap

    fits = "fits" if report["fits"] else "DOES NOT FIT"
    chars = int(width_inches * 12)
    text = (
        f"{fits}: {short_name(str(report.get('model') or 'plan'), chars // 2)} on {report['topology']}, "
        f"{report['world_size']} devices, batch {report['batch_size_per_device']}/device, {report['optimizer']}"
    )
    return "\n".join(textwrap.wrap(text, chars))


def png_bytes(report: dict) -> bytes:
    import matplotlib.pyplot as plt

    fig = figure(report)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def figure(report: dict) -> Figure:
    """The matplotlib figure behind png_bytes: HBM bars over time bars, one bar per device. Every
    text is drawn literally: a table or model name holding `$...$` (a user's name) was parsed as
    mathtext and crashed the PNG and HTML reports with a ValueError traceback."""
    import matplotlib

    matplotlib.use("Agg")
    with matplotlib.rc_context({"text.parse_math": False, "text.usetex": False}):
        return _draw(report)


def _draw(report: dict) -> Figure:
    import matplotlib.pyplot as plt

    devices = report["devices"]
    ranks = [d["rank"] for d in devices]
    width = min(18, max(8, len(ranks) * 0.12 + 4))
    fig, (ax_m, ax_t) = plt.subplots(2, 1, figsize=(width, 8), sharex=True)
    bottom = [0.0] * len(ranks)
    for key, label in _HBM_PARTS:
        vals = [d.get(key, 0) / GiB for d in devices]  # reports written before a part existed lack it
        ax_m.bar(ranks, vals, bottom=bottom, label=label, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals)]
    cap = devices[0]["hbm_capacity_bytes"] / GiB
    ax_m.axhline(cap, color="red", linestyle="--", linewidth=1.2, label=f"capacity {cap:.1f} GiB")
    ax_m.set_ylim(0, max([cap] + bottom) * 1.3)  # room above the capacity line for the legend
    ax_m.set_ylabel("HBM per device (GiB)")
    ax_m.legend(loc="upper right", fontsize=8, ncol=3)
    ax_m.set_title(title(report, width))
    bottom = [0.0] * len(ranks)
    for key, label in _TIME_PARTS:
        vals = [d[key] for d in devices]
        ax_t.bar(ranks, vals, bottom=bottom, label=label, width=0.85)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_t.axhline(
        report["estimated_step_time_ms"],
        color="black",
        linestyle=":",
        linewidth=1,
        label=f"step (max) {report['estimated_step_time_ms']:.3f} ms",
    )
    ax_t.set_ylim(0, max(bottom) * 1.3 or 1.0)
    for rank, label in hot_device_labels(report).items():
        ax_t.text(rank, bottom[ranks.index(rank)], label, ha="center", va="bottom", fontsize=7)
    ax_t.set_ylabel("estimated time per step (ms)")
    ax_t.set_xlabel("device (torch rank)")
    ax_t.legend(loc="upper right", fontsize=8, ncol=4)
    fig.tight_layout()
    return fig
