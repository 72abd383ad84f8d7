"""TPU generations, slice names, and the torchrec `Topology` the planner plans against.

Everything here is plain data plus parsing: no TPU, TorchTPU or JAX is needed, so a laptop can plan
for a v5p-128. Units: bytes and bytes per second here; torchrec's `Topology` wants bytes per
millisecond, converted in `make_topology`. One device = one torch rank.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from tpurec.errors import UserError
from tpurec.planner.cpu_cost import DEFAULT_CPU_COSTS, CpuCosts
from tpurec.runtime import device as _device
from tpurec.runtime.device import DeviceKind

if TYPE_CHECKING:  # the class itself is made on first use (_tpu_topology_class)
    from torchrec.distributed.planner.types import Topology as TpuTopology

logger = logging.getLogger(__name__)

GiB = 1024**3
GB = 10**9


def format_bytes(n: float) -> str:
    """'95.00 GiB', '1.50 MiB', '832 B': the largest binary unit that keeps the figure >= 1, so small
    models never read '0.00 GiB'."""
    for unit, size in (("TiB", 1024**4), ("GiB", GiB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


# Assumptions with no published per-device figure (see docs/planner.md, "Perf model").
# DCN between slices: Cloud TPU multislice docs describe data-center-network links per host; we
# assume 25 GB/s per host (one 200 Gbps NIC). Configurable per call.
DEFAULT_DCN_BW_PER_HOST = 25 * GB
# SparseCore gather/scatter reaches only part of HBM bandwidth (small random rows); no published
# figure, so we assume 30% of HBM bandwidth. Configurable per call, reported in every plan JSON.
DEFAULT_SC_GATHER_FRACTION = 0.3
# All-to-all on a torus is bisection-bound: assume a device sustains half its ICI bandwidth.
DEFAULT_A2A_EFFICIENCY = 0.5


@dataclass(frozen=True)
class Generation:
    name: str
    hbm_bytes: int  # per device
    hbm_bw: float  # bytes/s per device
    bf16_flops: float  # per device
    ici_bw_per_chip: float  # bytes/s, bidirectional
    ici_shape: str
    sparsecores: int  # usable SparseCores per device (0: the kernel cannot run)
    chips_per_host: int
    devices_per_chip: int
    name_counts: str  # "tensorcores" (2 per chip) or "chips": what N in "<gen>-N" counts
    source: str
    # Chips in the largest single slice (see _SLICE_CHIPS for the shapes and their sources).
    max_chips_per_slice: int = 0
    # Chips per host of a slice spanning several hosts, where it differs from chips_per_host.
    multi_host_chips_per_host: int | None = None

    @property
    def devices_per_host(self) -> int:
        return self.chips_per_host * self.devices_per_chip


GENERATIONS: dict[str, Generation] = {
    # Source: cloud.google.com/tpu/docs/v5p (95 GiB HBM2e, 2765 GB/s, 459 bf16 TFLOPs, ICI 1200 GB/s
    # bidirectional per chip, 3D torus, 4 chips per host, slice names count TensorCores: v5p-8 = 4
    # chips); jax/_src/tpu_info.py; SparseCores per device from jax-tpu-embedding NUM_SC_PER_DEVICE_MAP.
    # Megacore: the 2 TensorCores of a chip are one device, so one torch rank per chip.
    "v5p": Generation(
        "v5p",
        95 * GiB,
        2765 * GB,
        459e12,
        1200 * GB,
        "3D torus",
        4,
        4,
        1,
        "tensorcores",
        "cloud.google.com/tpu/docs/v5p; jax/_src/tpu_info.py; jax-tpu-embedding NUM_SC_PER_DEVICE_MAP",
    ),
    # Source: cloud.google.com/tpu/docs/v6e (32 GB HBM, 1638 GB/s, 918 bf16 TFLOPs, ICI 800 GB/s
    # bidirectional, 2D torus, v6e-8 host = 8 chips, names count chips); SparseCores:
    # jax-tpu-embedding NUM_SC_PER_DEVICE_MAP (2).
    "v6e": Generation(
        "v6e",
        32 * GB,
        1638 * GB,
        918e12,
        800 * GB,
        "2D torus",
        2,
        8,
        1,
        "chips",
        "cloud.google.com/tpu/docs/v6e; jax/_src/tpu_info.py; jax-tpu-embedding NUM_SC_PER_DEVICE_MAP",
        # Multi-host v6e slices run on 4-chip VMs (machine type ct6e-standard-4t; v6e-16 = 4 hosts x 4
        # chips): cloud.google.com/tpu/docs/v6e, "VM types" table. Only v6e-8 is one 8-chip host.
        multi_host_chips_per_host=4,
    ),
    # Source: cloud.google.com/tpu/docs/tpu7x (per chip: 192 GiB HBM, 7.37 TB/s, 2307 bf16 TFLOPs,
    # ICI 1.2 TB/s bidirectional, 3D torus; 2 TensorCores exposed as 2 devices per chip; 4 chips per
    # host; names count chips). Per-device values below are per-chip / 2. SparseCores per device:
    # jax-tpu-embedding NUM_SC_PER_DEVICE_MAP (2).
    "v7x": Generation(
        "v7x",
        96 * GiB,
        3685 * GB,
        1153.5e12,
        1200 * GB,
        "3D torus",
        2,
        4,
        2,
        "chips",
        "cloud.google.com/tpu/docs/tpu7x; jax/_src/tpu_info.py; jax-tpu-embedding NUM_SC_PER_DEVICE_MAP",
    ),
    # Source: cloud.google.com/tpu/docs/v5e (16 GB HBM, 819 GB/s, 197 bf16 TFLOPs, ICI 400 GB/s,
    # 2D torus, up to 8 chips per host, v5litepod-N counts chips). No SparseCore.
    "v5e": Generation(
        "v5e",
        16 * GB,
        819 * GB,
        197e12,
        400 * GB,
        "2D torus",
        0,
        8,
        1,
        "chips",
        "cloud.google.com/tpu/docs/v5e; jax/_src/tpu_info.py",
    ),
    # Source: cloud.google.com/tpu/docs/v4 (32 GiB HBM, 1200 GB/s, 275 bf16 TFLOPs, 3D torus, 4 chips
    # per host, megacore, names count TensorCores: v4-8 = 4 chips). ICI 300 GB/s per chip is an
    # ASSUMPTION from the v4 docs' link figures. v4 has SparseCores, but no public API drives them,
    # so 0 usable.
    "v4": Generation(
        "v4",
        32 * GiB,
        1200 * GB,
        275e12,
        300 * GB,
        "3D torus",
        0,
        4,
        1,
        "tensorcores",
        "cloud.google.com/tpu/docs/v4; jax/_src/tpu_info.py",
    ),
}


def _cube_slices(sub_cube: tuple[int, ...], max_cubes: tuple[int, int, int]) -> tuple[int, ...]:
    """Chip counts of a 3D-torus generation: the shapes below one 4x4x4 cube, then whole cubes
    (every side a multiple of 4 chips) up to `max_cubes` cubes per side (sorted)."""
    a_max, b_max, c_max = max_cubes
    cubes = {a * b * c for a in range(1, a_max + 1) for b in range(a, b_max + 1) for c in range(b, c_max + 1)}
    return tuple(sorted(set(sub_cube) | {64 * k for k in cubes}))


# The chip counts of real Cloud TPU slices, per generation (one slice; multislice multiplies them).
_SLICE_CHIPS: dict[str, tuple[int, ...]] = {
    # cloud.google.com/tpu/docs/v6e, "Supported configurations": 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16,
    # 16x16 (v6e-1 ... v6e-256).
    "v6e": (1, 4, 8, 16, 32, 64, 128, 256),
    # cloud.google.com/tpu/docs/v5e, "Configurations": the same 2D shapes, 1x1 to 16x16.
    "v5e": (1, 4, 8, 16, 32, 64, 128, 256),
    # cloud.google.com/tpu/docs/v5p, "Configurations": 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, then whole
    # 4x4x4 cubes up to 16x16x24 (6,144 chips, "the largest job that can be scheduled"); the page's
    # table lists the common shapes and "most (but not all)" full-cube shapes, so any whole-cube box
    # inside 16x16x24 is accepted.
    "v5p": _cube_slices((4, 8, 16, 32), (4, 4, 6)),
    # cloud.google.com/tpu/docs/tpu7x: a 3D torus like v5p, 4 chips per host, 9,216 chips per pod
    # (16x24x24 in cubes of 4x4x4). The page gives no shape table we could read, so the v5p rule up to
    # the pod is an ASSUMPTION.
    "v7x": _cube_slices((4, 8, 16, 32), (4, 6, 6)),
    # cloud.google.com/tpu/docs/v4, "Configurations": 2x2x1 (v4-8) ... 4x4x4, whole cubes up to a
    # 16x16x16 pod (4,096 chips).
    "v4": _cube_slices((4, 8, 16, 32), (4, 4, 4)),
}
GENERATIONS = {k: replace(g, max_chips_per_slice=max(_SLICE_CHIPS[k])) for k, g in GENERATIONS.items()}
# tpurec's own bound on a multislice job (no published limit): planning time grows with devices.
MAX_MULTISLICE_CHIPS = 65536
# The most devices tpurec plans for: those of the largest single Cloud TPU slice (v7x-9216: 9,216
# chips x 2 devices, from the tables above). Planning time and memory grow about linearly with
# devices (criteo-kaggle on 18,432 devices: about a minute and 1.8 GB, docs/results.md); a multislice
# job or a cpu-N dry run beyond it is refused at once.
MAX_PLAN_DEVICES = max(g.max_chips_per_slice * g.devices_per_chip for g in GENERATIONS.values())
LARGEST_SLICE = max(GENERATIONS.values(), key=lambda g: g.max_chips_per_slice * g.devices_per_chip)
_ALIASES = {"tpu7x": "v7x", "v5litepod": "v5e"}

_NAME_PER_CHIP = 2 if LARGEST_SLICE.name_counts == "tensorcores" else 1  # what N in "<gen>-N" counts
_LARGEST_NAME = f"{LARGEST_SLICE.name}-{LARGEST_SLICE.max_chips_per_slice * _NAME_PER_CHIP}"
_DEVICE_BOUND = (
    f"tpurec plans at most {MAX_PLAN_DEVICES:,} devices, those of the largest Cloud TPU slice "
    f"({_LARGEST_NAME}; planning time grows with devices)"
)

SLICE_FORMS = (
    "v5p-N (N = TensorCores, even: v5p-8 is 4 chips), v6e-N (N = chips), v7x-N or tpu7x-N (N = chips, "
    "2 devices each), v5e-N / v5litepod-N (chips), v4-N (TensorCores); optional multislice prefix "
    "'Kx' as in 2xv5p-128"
)
_SLICE_RE = re.compile(r"^(?:(\d+)x)?([a-z0-9]+)-(\d+)$")


@dataclass(frozen=True)
class SliceSpec:
    """A set of identical TPU slices (1 unless multislice), and the cost-model assumptions."""

    name: str
    generation: Generation
    chips_per_slice: int
    num_slices: int = 1
    dcn_bw_per_host: float = DEFAULT_DCN_BW_PER_HOST
    sc_gather_fraction: float = DEFAULT_SC_GATHER_FRACTION
    a2a_efficiency: float = DEFAULT_A2A_EFFICIENCY
    # CPU ranks only (cpu_spec): the measured terms of the CPU reference kernel and gloo (cpu_cost.py),
    # which replace the bandwidth model above.
    cpu_costs: CpuCosts | None = None

    @property
    def devices_per_slice(self) -> int:
        return self.chips_per_slice * self.generation.devices_per_chip

    @property
    def world_size(self) -> int:
        return self.devices_per_slice * self.num_slices

    @property
    def devices_per_host(self) -> int:
        gen = self.generation
        if self.devices_per_slice > gen.devices_per_host and gen.multi_host_chips_per_host:
            return gen.multi_host_chips_per_host * gen.devices_per_chip  # v6e-16 and up: 4-chip VMs
        # Sub-host slices (v6e-1, v6e-4) put every device on one host.
        return min(gen.devices_per_host, self.devices_per_slice)

    @property
    def hosts(self) -> int:
        return self.world_size // self.devices_per_host


def parse_slice(name: str, **assumptions: Any) -> SliceSpec:
    """Parse 'v5p-128', 'v6e-256', 'v7x-64', '2xv5p-128' ... into a SliceSpec."""
    m = _SLICE_RE.match(name.strip().lower())
    if not m:
        raise UserError(f"malformed TPU slice name {name!r}; valid forms: {SLICE_FORMS}")
    slices, gen_name, count = int(m.group(1) or 1), m.group(2), int(m.group(3))
    gen_name = _ALIASES.get(gen_name, gen_name)
    if gen_name not in GENERATIONS:
        raise UserError(f"unknown TPU generation {m.group(2)!r} in {name!r}; valid forms: {SLICE_FORMS}")
    gen = GENERATIONS[gen_name]
    if count <= 0 or slices <= 0:
        raise UserError(f"slice size must be positive in {name!r}; valid forms: {SLICE_FORMS}")
    if gen.name_counts == "tensorcores":
        if count % 2:
            raise UserError(f"{gen.name} slice names count TensorCores (2 per chip), so N must be even: {name!r}")
        chips = count // 2
    else:
        chips = count
    if chips > gen.max_chips_per_slice:
        raise UserError(
            f"{name!r}: {chips:,} chips, but a {gen.name} slice is at most {gen.max_chips_per_slice:,} chips; use "
            f"several slices (KxSLICE, e.g. 2x{slice_names(gen.name)[-1]})"
        )
    if chips not in _SLICE_CHIPS[gen.name]:
        raise UserError(f"{name.strip()!r} is not a Cloud TPU {gen.name} slice; {valid_slice_text(gen.name)}")
    if chips * slices > MAX_MULTISLICE_CHIPS:
        raise UserError(f"{name!r}: {chips * slices:,} chips in all; tpurec plans at most {MAX_MULTISLICE_CHIPS:,}")
    if chips * slices * gen.devices_per_chip > MAX_PLAN_DEVICES:
        raise UserError(f"{name!r}: {chips * slices * gen.devices_per_chip:,} devices in all; {_DEVICE_BOUND}")
    return SliceSpec(name=name.strip().lower(), generation=gen, chips_per_slice=chips, num_slices=slices, **assumptions)


def cpu_ranks(name: str) -> int:
    """N of a `cpu-N` dry-run topology, 1 <= N <= MAX_PLAN_DEVICES (UserError naming the bound)."""
    n = name.split("-", 1)[1]
    if not n.isdigit() or int(n) < 1:
        raise UserError(f"bad CPU topology {name!r}: use cpu-N with N >= 1 ranks")
    if int(n) > MAX_PLAN_DEVICES:
        raise UserError(f"{name!r}: {int(n):,} CPU ranks; {_DEVICE_BOUND}")
    return int(n)


def slice_names(generation: str) -> list[str]:
    """Every single-slice name of a generation, smallest first (v6e-1, v6e-4, ...)."""
    gen = GENERATIONS[generation]
    per_chip = 2 if gen.name_counts == "tensorcores" else 1
    return [f"{gen.name}-{c * per_chip}" for c in _SLICE_CHIPS[generation]]


def valid_slice_text(generation: str) -> str:
    names = slice_names(generation)
    shown = ", ".join(names) if len(names) <= 12 else ", ".join(names[:8]) + ", ... " + names[-1]
    page = {"v7x": "tpu7x"}.get(generation, generation)
    return f"valid sizes: {shown} (cloud.google.com/tpu/docs/{page})"


# The name of cpu_spec's generation: the CPU reference kernel (in-place updates, DDR memory).
CPU_GENERATION = "cpu"


def cpu_spec(
    world_size: int,
    *,
    devices_per_host: int | None = None,
    num_sc_per_device: int = 4,
    memory_bytes: int = 64 * GiB,
    cpu_costs: CpuCosts | None = DEFAULT_CPU_COSTS,
) -> SliceSpec:
    """A dry-run 'generation' for compute_device="cpu": the CPU reference kernel emulates
    `num_sc_per_device` SparseCores per rank; memory is DDR (64 GiB per rank by default, an
    arbitrary but sane dry-run figure). Time comes from `cpu_costs` (terms measured on a CPU host,
    tpurec/planner/cpu_cost.py); the bandwidths below only fill torchrec's Topology fields."""
    gen = Generation(
        CPU_GENERATION,
        memory_bytes,
        50 * GB,
        1e12,
        50 * GB,
        "host",
        num_sc_per_device,
        devices_per_host or world_size,
        1,
        "chips",
        "dry-run defaults (assumptions)",
    )
    return SliceSpec(name=f"cpu-{world_size}", generation=gen, chips_per_slice=world_size, cpu_costs=cpu_costs)


_TOPOLOGY_CLASS = None


def _tpu_topology_class() -> type:
    """TpuTopology, defined on first use: torchrec (and torch) load only when a topology is made,
    so slice names are parsed and refused at once (`tpurec plan --topology v6e-3`)."""
    global _TOPOLOGY_CLASS
    if _TOPOLOGY_CLASS is None:
        from torchrec.distributed.planner.types import Topology as _TorchrecTopology

        class TpuTopology(_TorchrecTopology):
            """A torchrec Topology that also carries the SliceSpec the tpurec estimators read."""

            def __init__(self, spec: SliceSpec, compute_device: str, **kwargs: Any) -> None:
                self.spec = spec
                # make_topology is this topology's factory (it resolves and validates the hardware),
                # so torchrec's "constructed directly ... the job will fail" warning does not apply.
                kwargs.setdefault("created_by_factory", True)
                super().__init__(compute_device=compute_device, **kwargs)

        _TOPOLOGY_CLASS = TpuTopology
    return _TOPOLOGY_CLASS


def _enable_offline_tpu() -> None:
    """torchrec places shards on torch.device("tpu"), which only parses once a PrivateUse1 backend
    is named "tpu"; without torch_tpu nothing names it, so planning crashed (tpurec.runtime.device.name_tpu_backend)."""
    from tpurec.runtime.device import name_tpu_backend

    name_tpu_backend()


def _spec_from_environment() -> SliceSpec | None:
    # Set by Cloud TPU VMs, e.g. TPU_ACCELERATOR_TYPE=v5p-128.
    name = os.environ.get("TPU_ACCELERATOR_TYPE")
    return parse_slice(name) if name else None


def make_topology(
    spec: str | SliceSpec | None,
    world_size: int | None = None,
    compute_device: str = "tpu",
    *,
    dcn_bw_per_host: float | None = None,
    sc_gather_fraction: float | None = None,
    hbm_cap: int | None = None,
    num_sc_per_device: int = 4,
    host_cap: int | None = None,
) -> TpuTopology:
    """Topology for a slice name ('v5p-8'), or, with spec=None, a generic one for `compute_device`
    with `world_size` devices (the TPU_ACCELERATOR_TYPE generation if set, else v5p with a warning;
    CPU: a dry-run topology where tables live in DDR). On a TPU `ddr_cap` is each device's host
    memory (`host_cap`, default host_memory.py's figure for the generation): the host tier's."""
    if compute_device not in tuple(DeviceKind):
        raise UserError(f"compute_device must be 'tpu' or 'cpu', not {compute_device!r}")
    if isinstance(spec, str) and spec.lower().startswith("cpu-"):
        # "cpu-N": a CPU dry run with N ranks, the form `tpurec plan --topology` accepts too.
        n = cpu_ranks(spec)
        if world_size is not None and world_size != n:
            raise UserError(f"{spec} has {n} ranks but world_size={world_size}")
        return make_topology(None, n, "cpu", num_sc_per_device=num_sc_per_device, hbm_cap=hbm_cap)
    if isinstance(spec, str):
        spec = parse_slice(spec)
    if spec is None:
        if world_size is None:
            raise UserError("make_topology(None, ...) needs world_size")
        if compute_device == DeviceKind.CPU:
            spec = cpu_spec(world_size, num_sc_per_device=num_sc_per_device)
        else:
            env = _spec_from_environment()
            emulated = _device.emulated_slice()
            running = env or (parse_slice(emulated) if emulated else None)  # the slice this rank is one of
            host = _device.tpu_generation()  # the chips of this host, from PCI ids (None off a TPU VM)
            gen = env.generation if env else GENERATIONS.get(host or "", GENERATIONS["v5p"])
            if env is None and host is None:
                logger.warning("no TPU slice given and TPU_ACCELERATOR_TYPE unset: planning for v5p devices")
            chips = -(-world_size // gen.devices_per_chip)
            spec = SliceSpec(name=f"{gen.name}x{world_size}dev", generation=gen, chips_per_slice=chips)
            if running is not None and running.world_size == world_size:
                spec = running  # its name in the plan's header ("v5p-16", not "v5px8dev")
    if world_size is not None and world_size != spec.world_size:
        raise UserError(f"{spec.name} has {spec.world_size} devices but world_size={world_size}")
    # A generation without SparseCores (v5e, v4) plans for the TensorCore kernel, which reads the
    # SparseCore layout with one partition set per device (tpurec/embedding/tensorcore).
    overrides: dict[str, Any] = {
        k: v
        for k, v in (("dcn_bw_per_host", dcn_bw_per_host), ("sc_gather_fraction", sc_gather_fraction))
        if v is not None
    }
    spec = replace(spec, **overrides)
    gen = spec.generation
    cap = hbm_cap if hbm_cap is not None else gen.hbm_bytes
    if compute_device == DeviceKind.TPU:
        from tpurec.planner.host_memory import host_bytes_per_device

        _enable_offline_tpu()
        host_memory = host_cap if host_cap is not None else host_bytes_per_device(gen.name, gen.devices_per_chip)
        memory = {"hbm_cap": cap, "ddr_cap": host_memory}
    else:
        memory = {"hbm_cap": 0, "ddr_cap": cap}
    per_ms = 1e-3
    return _tpu_topology_class()(
        spec,
        compute_device,
        world_size=spec.world_size,
        local_world_size=spec.devices_per_host,
        hbm_mem_bw=gen.hbm_bw * per_ms,
        intra_host_bw=gen.ici_bw_per_chip / gen.devices_per_chip * per_ms,
        inter_host_bw=spec.dcn_bw_per_host / spec.devices_per_host * per_ms,
        **memory,
    )
