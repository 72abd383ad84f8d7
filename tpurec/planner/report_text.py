"""A plan report (inspect.build_report) as text, and the difference between two reports.

Memory figures carry their own unit (`topology.format_bytes`), devices with identical figures share
one row (a v6e-256 plan is a few rows, not 256), and the slowest devices are named with the tables
that take their time.
"""

from __future__ import annotations

from collections.abc import Callable

from tpurec.planner.topology import format_bytes
from tpurec.runtime.device import DeviceKind

DEVICES_HEADER = "devices (memory; ms per step; identical devices share a row)"
HOT_DEVICES = 3  # slowest devices named with their top tables


def rank_ranges(ranks: list[int], most: int = 6) -> str:
    """'0-3,8,10-63' (sorted, consecutive ranks merged); more than `most` runs end in '+N more'."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    parts = [f"{a}-{b}" if b > a else f"{a}" for a, b in runs]
    return ",".join(parts[:most]) + (f",+{len(parts) - most} more" if len(parts) > most else "")


def ranks_in_order(ranks: list) -> str:
    """A table's ranks in shard order (order matters there: it is the row order of the shards)."""
    if len(ranks) > 4 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def fitting_text(report: dict) -> str:
    """'v5p-16, v6e-64, v7x-8' from a refused report's smallest_fitting_topology."""
    found = report.get("smallest_fitting_topology") or {}
    return ", ".join(name or f"no {gen} slice" for gen, name in found.items()) or "none computed"


_MEMORY = ("hbm_used_bytes", "hbm_capacity_bytes")
_PARTS = ("weights_bytes", "optimizer_bytes", "buffers_bytes", "activations_bytes", "transient_bytes", "reserved_bytes")
_TIMES = ("estimated_time_ms", "lookup_ms", "update_ms", "comm_ms")


def device_cells(d: dict) -> tuple[str, ...]:
    """A device's figures as the text report prints them; devices with equal cells share a row."""
    pct = 100 * d["hbm_used_bytes"] / d["hbm_capacity_bytes"]
    return (
        *(format_bytes(d[k]) for k in _MEMORY),
        f"{pct:.1f}",
        *(format_bytes(d.get(k, 0)) for k in _PARTS),  # reports written before a part existed lack it
        *(f"{d[k]:.3f}" for k in _TIMES),
    )


def device_groups(devices: list[dict], key: Callable[[dict], tuple] = device_cells) -> list[tuple[list[int], dict]]:
    """(ranks, first device) per set of devices with equal `key`, ordered by their lowest rank."""
    groups: dict[tuple, list[dict]] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    return sorted([([d["rank"] for d in g], g[0]) for g in groups.values()], key=lambda rg: rg[0][0])


def _device_rows(devices: list[dict]) -> list[str]:
    head = ("used", "cap", "%", "weights", "optim", "buffers", "activ", "transnt", "reserved")
    widths = (10, 10, 5, 10, 10, 10, 10, 10, 10, 7, 7, 7, 7)
    out = [
        f"{'devs':>4} "
        + " ".join(f"{h:>{w}}" for h, w in zip((*head, "time", "lookup", "update", "comm"), widths))
        + "  ranks"
    ]
    for ranks, d in device_groups(devices):
        out.append(
            f"{len(ranks):>4} "
            + " ".join(f"{c:>{w}}" for c, w in zip(device_cells(d), widths))
            + f"  {rank_ranges(ranks)}"
        )
    return out


def hot_devices(devices: list[dict], count: int = HOT_DEVICES) -> list[tuple[list[int], dict]]:
    """The `count` slowest kinds of device, slowest first: (ranks, one device) per set of devices
    with the same time and the same top tables (on big slices many devices are alike)."""
    groups: dict[tuple, list[dict]] = {}
    for d in devices:
        key = (round(d["estimated_time_ms"], 6), tuple(t["name"] for t in d.get("top_tables", [])))
        groups.setdefault(key, []).append(d)
    ordered = sorted(groups.values(), key=lambda g: (-g[0]["estimated_time_ms"], g[0]["rank"]))
    return [([d["rank"] for d in g], g[0]) for g in ordered[:count]]


def _hot_lines(devices: list[dict]) -> list[str]:
    out = []
    for ranks, d in hot_devices(devices):
        tables = ", ".join(f"{t['name']} {t['time_ms']:.3f} ms" for t in d.get("top_tables", [])) or "no tables"
        label = ("rank " if len(ranks) == 1 else "ranks ") + rank_ranges(ranks)
        out.append(f"  {label:<14} {d['estimated_time_ms']:8.3f} ms: {tables}")
    return out


def _pipelined_line(report: dict) -> list[str]:
    """What overlap would give (docs/planner.md "Which stages overlap"); TPU plans only."""
    t = report.get("pipelined_step_time_ms")
    if t is None:
        return []
    return [
        f"pipelined step: {t:.3f} ms (SparseCore lookups and updates, ICI collectives and the host's input "
        "dist overlapped; above: one after the other)"
    ]


def _tier_cells(t: dict) -> str:
    """A table's tier, cache rows and expected hit rate ('-' where unknown: no hot-row curve)."""
    if t.get("tier") != "host":
        return f"{t.get('tier', 'hbm'):<5} {'-':>12} {'-':>6}"
    hit = t.get("expected_hit_rate")
    return f"{'host':<5} {t['cache_rows']:>12,} {(f'{hit:.1%}' if hit is not None else '-'):>6}"


def _tier_text(t: dict) -> str:
    """'hbm', or 'host, cache 1,200,000 rows' (the host tier's cache is part of where a table is)."""
    return f"host, cache {t['cache_rows']:,} rows" if t.get("tier") == "host" else "hbm"


def _host_tier_lines(report: dict) -> list[str]:
    """The host tier's summary: its tables, their caches and the host memory they take."""
    host = [t for t in report["tables"] if t.get("tier") == "host"]
    if not host:
        return []
    d = max(report["devices"], key=lambda d: d.get("host_used_bytes", 0))
    one_memory = report.get("compute_device") == DeviceKind.CPU
    where = (
        "in the ranks' memory beside their caches (CPU: one memory)"
        if one_memory
        else f"up to {format_bytes(d['host_used_bytes'])} of {format_bytes(d['host_capacity_bytes'])} host memory "
        f"per device (rank {d['rank']}, {format_bytes(d['host_reserved_bytes'])} of it reserved)"
    )
    out = [f"host tier: {len(host)} table(s) in host memory behind a device cache of their rows, {where}"]
    if not one_memory:  # the plan is honest about a tier no chip has run yet
        out.append(
            "  (the host tier runs on the TPU path, tested on the emulated TPU; not yet measured on a chip: "
            "docs/host_tier.md)"
        )
    for t in sorted(host, key=lambda t: -t["host_bytes"]):
        hit = t.get("expected_hit_rate")
        out.append(
            f"  {t['name']:<12} cache {t['cache_rows']:,} of {t['rows']:,} rows (load factor {t['load_factor']:g}, "
            f"{t['cache_algorithm']}), host {format_bytes(t['host_bytes'])}, expected hit rate "
            + (f"{hit:.1%}" if hit is not None else "unknown (no hot-row curve: tpurec data stats, then --limits)")
        )
    return out


def kernel_assumption(a: dict) -> str:
    """How the plan priced lookups and updates (the report's assumptions), in a few words."""
    if a.get("kernel_time") == "tensorcore-measured":
        return "TensorCore kernel at its per-id costs measured on v5e"
    bw = a["sc_gather_bw_bytes_per_s"] / 1e9
    return f"SparseCore gather {a['sc_gather_fraction_of_hbm_bw']:.0%} of HBM bw ({bw:.0f} GB/s)"


def _pooling_lines(report: dict) -> list[str]:
    """The TensorCore kernel's pooling per stack (v5e, v4): Pallas where its output fits VMEM."""
    stacks = report.get("tensorcore_pooling") or []
    if not stacks:
        return []
    out = ["", "TensorCore pooling per stack (Pallas, x its output copies, where they fit VMEM; else XLA's)"]
    for s in stacks:
        tables = ", ".join(s["tables"][:4]) + (f" +{len(s['tables']) - 4}" if len(s["tables"]) > 4 else "")
        how = f"pallas x{s['accumulators']}" if s["pooling"] == "pallas" else s["pooling"]
        out.append(
            f"  {s['stack']:<14} {s['segments']:>10,} segments x {s['width']:<4} {how:<9} "
            f"VMEM {format_bytes(s['vmem_bytes'])} of {format_bytes(s['vmem_capacity_bytes'])}: {tables}"
        )
    return out


def format_text(report: dict, top: int = 5) -> str:
    a = report["assumptions"]
    cap = report["devices"][0]["hbm_capacity_bytes"]
    out = [
        f"tpurec plan: {report.get('model') or 'tables'} on {report['topology']} "
        f"({report['world_size']} devices, {format_bytes(cap)} each), batch {report['batch_size_per_device']}/device, "
        f"optimizer {report['optimizer']}"
        + (f" ({report['optimizer_source']})" if report.get("optimizer_source") else ""),
        f"fits: {'yes' if report['fits'] else 'NO'}    estimated embedding step time: "
        f"{report['estimated_step_time_ms']:.3f} ms    imbalance (max/mean): time "
        f"{report['time_imbalance']:.2f}, HBM {report['hbm_imbalance']:.2f}",
        *_pipelined_line(report),
        f"assumptions: {kernel_assumption(a)}, all-to-all efficiency {a['all_to_all_efficiency']}, "
        f"DCN {a['dcn_bw_per_host_bytes_per_s'] / 1e9:.0f} GB/s per host, headroom {a['headroom_fraction']:.0%}",
    ]
    devices = report["devices"]
    if "measured" in a.get("id_limit", ""):
        worst = max(d.get("worst_case_buffers_bytes", 0) for d in devices)
        out.append(
            f"id limits: {a['id_limit']}: SparseCore buffers up to "
            f"{format_bytes(max(d['buffers_bytes'] for d in devices))} per device (worst case {format_bytes(worst)})"
        )
    if report.get("host_remap_bytes_per_rank"):
        remaps = [t for t in report["tables"] if t.get("remap_host_bytes")]
        out.append(
            f"host memory: managed-collision remaps of {len(remaps)} table(s), up to "
            f"{format_bytes(max(report['host_remap_bytes_per_rank']))} per rank (host RAM, not HBM)"
        )
    if report.get("refusal"):
        out += [f"refused: {report['refusal']}", f"smallest fitting slice: {fitting_text(report)}"]
    tiered = any(t.get("tier") == "host" for t in report["tables"])
    out += _host_tier_lines(report) + [
        "",
        "tables (largest first)",
        f"{'name':<12} {'rows':>12} {'dim':>4} {'pool':>6} {'sharding':<16} {'kernel':<18} {'ranks':<12} "
        f"{'memory':>10} {'ms':>8}" + (f" {'tier':<5} {'cache rows':>12} {'hit':>6}" if tiered else ""),
    ]
    for t in sorted(report["tables"], key=lambda t: -t["bytes"]):
        out.append(
            f"{t['name']:<12} {t['rows']:>12,} {t['dim']:>4} {t['pooling_factor']:>6g} "
            f"{t['sharding_type']:<16} {t['compute_kernel']:<18} {ranks_in_order(t['ranks']):<12} "
            f"{format_bytes(t['bytes']):>10} {t['time_ms']:>8.3f}" + (f" {_tier_cells(t)}" if tiered else "")
        )
    out += _pooling_lines(report)
    out += ["", DEVICES_HEADER, *_device_rows(report["devices"])]
    out += ["", "slowest devices and the tables that take their time", *_hot_lines(report["devices"])]
    notes = [f"  {t['name']}: {t['note']}" for t in report["tables"] if t.get("note")]
    if notes:
        out += ["", "notes"] + notes
    out += ["", f"top {top} tables by time"]
    for t in sorted(report["tables"], key=lambda t: -t["time_ms"])[:top]:
        out.append(
            f"  {t['name']:<12} {t['time_ms']:8.3f} ms summed over {len(t['shards'])} shard(s), {t['sharding_type']}"
        )
    return "\n".join(out)


_INPUTS = (
    ("model", "model"),
    ("topology", "topology"),
    ("compute_device", "compute device"),
    ("batch_size", "batch size per device"),
    ("optimizer", "optimizer"),
    ("headroom_fraction", "headroom"),
    ("sc_gather_fraction", "SparseCore gather fraction"),
    ("dcn_bw_per_host", "DCN bytes/s per host"),
    ("reserved_bytes", "reserved bytes per device"),
)


def input_changes(a: dict, b: dict) -> list[str]:
    """What differs between the inputs (meta) of two reports: settings, and tables added, removed
    or changed field by field."""
    ma, mb = a.get("meta") or {}, b.get("meta") or {}
    out = [f"  {label}: {ma.get(k)!r} -> {mb.get(k)!r}" for k, label in _INPUTS if ma.get(k) != mb.get(k)]
    ta = {t["name"]: t for t in ma.get("tables", [])}
    tb = {t["name"]: t for t in mb.get("tables", [])}
    for name in sorted(set(ta) | set(tb), key=lambda n: (len(n), n)):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            out.append(f"  table {name}: {'added in B' if x is None else 'removed in B'}")
            continue
        changed = [f"{k} {x.get(k)!r} -> {y.get(k)!r}" for k in sorted(set(x) | set(y)) if x.get(k) != y.get(k)]
        if changed:
            out.append(f"  table {name}: " + ", ".join(changed))
    return out


def diff_reports(a: dict, b: dict) -> str:
    """What changed from plan A to plan B: the inputs, tables whose placement moved, and the headline
    numbers."""
    ta = {t["name"]: t for t in a["tables"]}
    tb = {t["name"]: t for t in b["tables"]}
    out = [f"A: {a['topology']} {a['world_size']} devices; B: {b['topology']} {b['world_size']} devices"]
    if a.get("model") != b.get("model"):
        # Said first: every table line below then compares two models' tables, not two placements.
        out.append(
            f"note: A and B plan different models ({a.get('model')!r} and {b.get('model')!r}): the tables differ, "
            "so this compares two models, not two placements of one"
        )
    inputs = input_changes(a, b)
    out += ["inputs: the same"] if not inputs else [f"inputs: {len(inputs)} change(s)", *inputs]
    for key, label, fmt in (
        ("estimated_step_time_ms", "step time ms", "{:.4g}"),
        ("time_imbalance", "time imbalance", "{:.2f}"),
        ("hbm_imbalance", "HBM imbalance", "{:.2f}"),
    ):
        out.append(f"{label:<16} {fmt.format(a[key])} -> {fmt.format(b[key])}")
    max_a = max(d["hbm_used_bytes"] for d in a["devices"])
    max_b = max(d["hbm_used_bytes"] for d in b["devices"])
    out.append(f"{'max HBM':<16} {format_bytes(max_a)} -> {format_bytes(max_b)}")
    out.append(f"{'fits':<16} {a['fits']} -> {b['fits']}")
    changed, moved = 0, []
    for name in sorted(set(ta) | set(tb), key=lambda n: (len(n), n)):
        x, y = ta.get(name), tb.get(name)
        if x is None or y is None:
            moved.append(f"  {name}: only in {'B' if x is None else 'A'}")
            changed += 1
            continue
        sx = [(s["rank"], s["offsets"], s["sizes"]) for s in x["shards"]]
        sy = [(s["rank"], s["offsets"], s["sizes"]) for s in y["shards"]]
        tiers = (_tier_text(x), _tier_text(y))
        if (x["sharding_type"], x["compute_kernel"], sx, tiers[0]) != (
            y["sharding_type"],
            y["compute_kernel"],
            sy,
            tiers[1],
        ):
            changed += 1
            moved.append(
                f"  {name}: {x['sharding_type']} ranks {ranks_in_order(x['ranks'])} -> "
                f"{y['sharding_type']} ranks {ranks_in_order(y['ranks'])}"
                + (
                    f" (kernel {x['compute_kernel']} -> {y['compute_kernel']})"
                    if x["compute_kernel"] != y["compute_kernel"]
                    else ""
                )
                + (f" (tier {tiers[0]} -> {tiers[1]})" if tiers[0] != tiers[1] else "")
            )
    return "\n".join([out[0], f"{changed} of {len(set(ta) | set(tb))} tables differ", *out[1:], *moved])
