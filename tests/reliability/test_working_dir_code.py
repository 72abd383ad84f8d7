"""No code from the working directory runs (#43): every process tpurec starts begins with the
working directory off `sys.path` (`tpurec.runtime.safe_path`).

Each test stands in a directory holding hostile `json.py`, `torch.py`, `pickle.py` and
`threading.py` (the last two are what a `spawn` worker's bootstrap imports first); each records
which process imported it and exits 97. From there it runs one launch path as a user would (the
`tpurec` console script, which never puts the working directory on sys.path itself) and asserts
the run worked and no hostile module ran. A user's script launched with `tpurec launch` still
imports its sibling modules from its own directory, as under `python prog.py`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.dlrm.helpers import REPO
from tpurec.runtime import safe_path

HOSTILE = ("json", "torch", "pickle", "threading")

# A user's program in its own directory, importing a sibling module: one JSON file per rank saying
# where it found its imports.
PROGRAM = textwrap.dedent("""
    import json, os, sys
    import helper  # a sibling module: found in the script's own directory

    cwd = os.path.realpath(os.getcwd())
    record = {
        "helper": helper.VALUE,
        "json": json.__file__,
        "path0": sys.path[0],
        "cwd_on_path": any(os.path.realpath(p or ".") == cwd for p in sys.path),
        "safepath": os.environ.get("PYTHONSAFEPATH"),
        "argv": sys.argv,
        "file": __file__,
        "name": __name__,
    }
    with open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(record, f)
""")


@pytest.fixture
def work(tmp_path) -> Path:
    """The working directory of the runs, with the hostile modules in it."""
    d = tmp_path / "work"
    d.mkdir()
    marker = tmp_path / "hostile-ran.txt"
    for name in HOSTILE:
        (d / f"{name}.py").write_text(
            "import os, sys\n"
            f"with open({str(marker)!r}, 'a') as f:\n"
            f"    f.write({name!r} + ' imported by ' + ' '.join(sys.orig_argv) + '\\n')\n"
            "os._exit(97)\n"
        )
    return d


def _assert_clean(work: Path, p: subprocess.CompletedProcess) -> None:
    marker = work.parent / "hostile-ran.txt"
    ran = marker.read_text() if marker.exists() else ""
    assert not ran, f"code from the working directory ran:\n{ran}"
    assert p.returncode == 0, p.stderr[-3000:]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **extra}
    env.pop("PYTHONSAFEPATH", None)  # as a user's shell has it
    return env


def _tpurec(*args, cwd: Path, env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """`tpurec ARGS` run from `cwd` as a user runs it: the console script (or `python -P -m tpurec.cli`,
    its equivalent, where the script is not installed)."""
    script = Path(sys.executable).with_name("tpurec")
    cmd = [str(script)] if script.exists() else [sys.executable, "-P", "-m", "tpurec.cli"]
    return subprocess.run(
        [*cmd, *map(str, args)], cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=timeout
    )


def _python(code: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A program calling tpurec's API from `cwd`, started as the console script is: a script in
    another directory (so not `cwd` on its sys.path), without `-P` (which its children would inherit)."""
    script = cwd.parent / "bin" / "program.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text(f"if __name__ == '__main__':  # spawn's children import it as __mp_main__\n    {code}\n")
    return subprocess.run(
        [sys.executable, str(script)], cwd=cwd, env=env or _env(), capture_output=True, text=True, timeout=600
    )


def _program(tmp_path: Path) -> Path:
    d = tmp_path / "prog"
    d.mkdir()
    (d / "helper.py").write_text("VALUE = 42\n")
    (d / "main.py").write_text(PROGRAM)
    return d / "main.py"


def _records(out: Path, ranks: int, prog: Path) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    assert len(files) == ranks, files
    records = [json.loads(f.read_text()) for f in files]
    for r in records:
        assert r["helper"] == 42 and r["path0"] == os.path.realpath(prog.parent) and not r["cwd_on_path"], r
        assert r["json"] == json.__file__, r  # the standard library's
        assert r["safepath"] is None, r  # the caller's environment, not tpurec's
        assert r["file"] == str(prog) and r["name"] == "__main__" and r["argv"] == [str(prog), str(out)], r
    return records


# ----- the helper ------------------------------------------------------------------------------


def test_children_get_a_safe_path_and_a_users_program_the_callers_environment(monkeypatch):
    monkeypatch.delenv("PYTHONSAFEPATH", raising=False)
    assert safe_path.python("-m", "x") == [sys.executable, "-P", "-m", "x"]
    env = safe_path.env({"A": "1"}, B="2")
    assert env == {"A": "1", "B": "2", "PYTHONSAFEPATH": "1", safe_path.CALLER_ENV: ""}
    assert safe_path.env(env)[safe_path.CALLER_ENV] == ""  # a nested launch keeps the outermost caller's
    assert safe_path.env({"PYTHONSAFEPATH": "yes"})[safe_path.CALLER_ENV] == "yes"
    # An empty PYTHONPATH entry is the working directory to Python: dropped.
    assert safe_path.env({"PYTHONPATH": f"{os.pathsep}/x{os.pathsep}"})["PYTHONPATH"] == "/x"
    assert "PYTHONPATH" not in safe_path.env({"PYTHONPATH": ""})
    with safe_path.spawning():
        assert os.environ["PYTHONSAFEPATH"] == "1" and os.environ[safe_path.CALLER_ENV] == ""
    assert "PYTHONSAFEPATH" not in os.environ and safe_path.CALLER_ENV not in os.environ
    # What a user's program gets back (`tpurec.runtime.run_script`): the caller's own setting.
    for caller, safe in (("", False), ("yes", True)):
        for k, v in safe_path.env({"PYTHONSAFEPATH": caller} if caller else {}).items():
            monkeypatch.setenv(k, v)
        assert safe_path.restore_caller_env() is safe and os.environ.get("PYTHONSAFEPATH") == (caller or None)
        assert safe_path.CALLER_ENV not in os.environ


def test_every_rank_command_starts_with_a_safe_path():
    from tpurec.dlrm.cli import RANK_PROGRAM
    from tpurec.launch import hosts

    train = hosts.agent_command(2, RANK_PROGRAM)
    assert train[:4] == [sys.executable, "-P", "-m", "tpurec.launch.agent"] and train[-2:] == ["-m", "tpurec.dlrm"]
    script = hosts.agent_command(4, ["prog.py", "--x"])
    assert script[:2] == [sys.executable, "-P"] and script[-4:] == ["-m", "tpurec.runtime.run_script", "prog.py", "--x"]
    module = hosts.agent_command(4, ["-m", "pkg.mod", "--x"])
    assert module[-3:] == ["-m", "pkg.mod", "--x"]


def test_the_bench_pipeline_child_starts_with_a_safe_path(monkeypatch):
    from tpurec.bench import pipeline

    seen = {}

    def fake_run(cmd, env, **_):
        seen.update(cmd=cmd, env=env)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"ok": 1}\n', stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert pipeline._spawn({"cores": 1}, [0]) == {"ok": 1}
    assert seen["cmd"][:2] == [sys.executable, "-P"] and seen["env"]["PYTHONSAFEPATH"] == "1"


# ----- each launch path, from a working directory holding hostile modules -----------------------


@pytest.mark.multiprocess
def test_train_nproc_2(work, tmp_path):
    argv = ["train", "--quiet", "--nproc", 2, "--synth-rows", 3000, "--steps", 2, "--eval-every", 0]
    p = _tpurec(*argv, "--curves-out", "none", "--keep", 0, cwd=work, env=_env(TPUREC_CACHE=str(tmp_path / "cache")))
    _assert_clean(work, p)
    assert json.loads(p.stdout.splitlines()[-1])["steps"] == 2


@pytest.mark.slow  # session 28: make test-all (the default suite's 20 minutes)
def test_launch_of_a_script_that_imports_its_sibling(work, tmp_path):
    prog, out = _program(tmp_path), tmp_path / "out"
    out.mkdir()
    p = _tpurec("launch", "--emulate-tpu", "v6e-1", prog, out, cwd=work)
    _assert_clean(work, p)
    _records(out, 1, prog)


@pytest.mark.slow  # 4 ranks
@pytest.mark.multiprocess
def test_launch_of_a_script_on_an_emulated_v5p_8(work, tmp_path):
    prog, out = _program(tmp_path), tmp_path / "out"
    out.mkdir()
    p = _tpurec("launch", "--emulate-tpu", "v5p-8", prog, out, cwd=work)
    _assert_clean(work, p)
    _records(out, 4, prog)


def test_data_convert_jobs_2(work, tmp_path):
    from tpurec.bench.data import write_criteo_tsv

    days = [tmp_path / f"day_{i}" for i in range(2)]
    for i, day in enumerate(days):
        write_criteo_tsv(str(tmp_path), str(day), 500, seed=i)
    p = _tpurec("data", "convert", *days, "--out", tmp_path / "pq", "--jobs", 2, "--quiet", cwd=work)
    _assert_clean(work, p)
    assert len(list((tmp_path / "pq").glob("part-*.parquet"))) == 2


def test_bench_torchrun_launch(work, tmp_path):
    """What `bench train` and `bench plan --calibrate` start for their ranks (`torchrun_json`)."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "rank_probe.py").write_text('import json, sys\nprint(json.dumps({"rank_argv": sys.argv[1:]}))\n')
    code = "from tpurec.bench.train import torchrun_json; print(torchrun_json('rank_probe', 1, ['a'], 'probe'))"
    p = _python(code, work, _env(PYTHONPATH=f"{mods}{os.pathsep}{REPO}"))
    _assert_clean(work, p)
    assert "'rank_argv': ['a']" in p.stdout


# torch_tpu's `torch.tpu.distributed` for the child asking it for the launch environment (one host).
FAKE_TORCH_TPU = textwrap.dedent("""
    import os, sys, types
    dist = types.ModuleType("torch.tpu.distributed")
    def set_tpu_launch_env(*, nnodes=None, nproc_per_node=None):
        os.environ["TORCH_TPU_SLICEBUILDER_ADDRESSES"] = "localhost:8471"
        os.environ["TORCH_TPU_TOPOLOGY"] = "1,1,1"
    dist.set_tpu_launch_env = set_tpu_launch_env
    tpu = types.ModuleType("torch.tpu")
    tpu.distributed = dist
    sys.modules["torch.tpu"] = tpu
    sys.modules["torch.tpu.distributed"] = dist
""")


def test_the_child_asking_torchtpu_for_its_launch_environment(work, tmp_path):
    """`train/launch --device tpu` ask TorchTPU's set_tpu_launch_env() in a `python -c` child."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "sitecustomize.py").write_text(FAKE_TORCH_TPU)
    code = "from tpurec.launch.hosts import torchtpu_launch_env; print(torchtpu_launch_env(1, 1))"
    p = _python(code, work, _env(PYTHONPATH=f"{fake}{os.pathsep}{REPO}"))
    _assert_clean(work, p)
    assert "'TORCH_TPU_TOPOLOGY': '1,1,1'" in p.stdout


@pytest.mark.slow  # two spawned gloo workers importing torch
@pytest.mark.multiprocess
def test_bench_cpu_cost_workers(work):
    """The spawned workers of `bench plan --calibrate`'s host terms."""
    code = "from tpurec.bench import cpu_costs; print(cpu_costs.collective_terms(reps=2)['world'])"
    p = _python(code, work)
    _assert_clean(work, p)
    assert p.stdout.strip() == "2"


@pytest.mark.slow  # a child importing jax and torch
def test_bench_pipeline(work, tmp_path):
    pytest.importorskip("jax_tpu_embedding")
    p = _tpurec("bench", "pipeline", "--quick", "--cores", "1", "--dir", tmp_path / "data", "--json", cwd=work)
    _assert_clean(work, p)


def test_launch_of_a_module_found_only_in_the_working_directory_is_one_line_naming_the_fix(work):
    (work / "mymod.py").write_text("raise SystemExit(97)\n")
    p = _tpurec("launch", "--emulate-tpu", "v6e-1", "--", "-m", "mymod", cwd=work)
    assert p.returncode == 2, p.stderr[-3000:]
    assert p.stderr.strip().splitlines() == [
        "tpurec launch: error: -m mymod: no module 'mymod' on PYTHONPATH or among the installed packages "
        "(the ranks never import from the working directory; PYTHONPATH=. adds it)"
    ]


def test_a_module_of_the_working_directory_is_found_when_put_on_pythonpath_on_purpose(tmp_path, monkeypatch):
    from tpurec.launch.cli import _module_problem

    (tmp_path / "mymod.py").write_text("raise SystemExit(97)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # a launcher that itself has the working directory on sys.path
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert "PYTHONPATH=. adds it" in (_module_problem("mymod.sub") or "")
    monkeypatch.setenv("PYTHONPATH", ".")
    assert _module_problem("mymod") is None
    assert _module_problem("json") is None and _module_problem("tpurec.dlrm") is None and _module_problem("sys") is None


@pytest.mark.slow  # four sides of 2 ranks each
@pytest.mark.multiprocess
def test_bench_train(work, tmp_path):
    argv = ["bench", "train", "--tables", "tiny", "--steps", 2, "--warmup", 1, "--repeats", 1, "--json"]
    p = _tpurec(*argv, cwd=work, env=_env(TPUREC_CACHE=str(tmp_path / "cache")))
    _assert_clean(work, p)


@pytest.mark.slow  # 12 plans trained in turns at 2 ranks, and the spawned host-term workers
@pytest.mark.multiprocess
def test_bench_plan_calibrate(work, tmp_path):
    argv = ["bench", "plan", "--calibrate", "--steps", 8, "--block", 4, "--paired-steps", 8, "--warmup", 1]
    p = _tpurec(*argv, "--rounds", 1, "--json", cwd=work, env=_env(TPUREC_CACHE=str(tmp_path / "cache")))
    _assert_clean(work, p)


# ----- --model-module: the user's module is imported without the working directory first (#61) ---

# What tpurec imports after the user's module (yaml: train's options; matplotlib: plan --format png;
# pyarrow/pandas: the data commands; tensorboard, tqdm): each a hostile stand-in in the working directory.
LATER = ("yaml", "matplotlib", "pyarrow", "pandas", "tensorboard", "tqdm")


def test_loading_a_model_module_leaves_sys_path_as_it_was(tmp_path, monkeypatch):
    """A file path puts nothing on sys.path; a dotted name finds its package in the working directory
    for that one import (appended, so it shadows nothing) and leaves no trace."""
    from tpurec.planner import model_module

    (tmp_path / "tpurec_probe_beside.py").write_text("X = 1\n")  # only the working directory holds it
    (tmp_path / "tpurec_probe_pkg").mkdir()
    (tmp_path / "tpurec_probe_pkg" / "__init__.py").write_text("")
    (tmp_path / "tpurec_probe_pkg" / "m.py").write_text("import json\nJSON = json.__file__\ndef build(): return 1\n")
    (tmp_path / "tpurec_probe_file.py").write_text("import json\nJSON = json.__file__\ndef build(): return 1\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or ".") != str(tmp_path)])
    before = list(sys.path)
    assert model_module.parse_target("tpurec_probe_pkg.m:build") == ("tpurec_probe_pkg.m", "build")
    assert sys.path == before
    by_name = model_module._import("tpurec_probe_pkg.m")
    assert sys.path == before and by_name.JSON == json.__file__
    by_path = model_module._import("./tpurec_probe_file.py")
    assert sys.path == before and by_path.JSON == json.__file__
    import importlib.util

    assert importlib.util.find_spec("tpurec_probe_beside") is None  # the working directory is not searched


def _hostile_later(work: Path) -> None:
    marker = work.parent / "hostile-ran.txt"
    for name in LATER:
        (work / f"{name}.py").write_text(
            "import os, sys\n"
            f"with open({str(marker)!r}, 'a') as f:\n"
            f"    f.write({name!r} + ' imported by ' + ' '.join(sys.orig_argv) + '\\n')\n"
            "os._exit(97)\n"
        )


@pytest.fixture
def model_work(work):
    """The hostile working directory holding the user's model, as a file and as a package."""
    _hostile_later(work)
    model = (REPO / "examples" / "my_model.py").read_text()
    (work / "my_model.py").write_text(model)
    (work / "my_models").mkdir()
    (work / "my_models" / "__init__.py").write_text("")
    (work / "my_models" / "ranker.py").write_text(model)
    return work


def test_plan_png_of_a_model_file(model_work, tmp_path):
    out = tmp_path / "plan.png"
    p = _tpurec(
        "plan",
        "--model-module",
        "./my_model.py:build",
        "--topology",
        "v5p-8",
        "--format",
        "png",
        "--out",
        out,
        cwd=model_work,
    )
    _assert_clean(model_work, p)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # 25 s; the default suite checks the import itself (above) and plan --format png
def test_data_synth_stats_and_train_of_a_model_package(model_work, tmp_path):
    """data synth, data stats and one-process train, the model given by its dotted name."""
    data, target = tmp_path / "data", "my_models.ranker:build"
    env = _env(TPUREC_CACHE=str(tmp_path / "cache"))
    p = _tpurec(
        "data", "synth", "--model-module", target, "--rows", 2000, "--out", data, "--quiet", cwd=model_work, env=env
    )
    _assert_clean(model_work, p)
    stats = [
        "data",
        "stats",
        "--model-module",
        target,
        data,
        "--topology",
        "v5p-8",
        "--out",
        tmp_path / "l.json",
    ]
    p = _tpurec(*stats, cwd=model_work, env=env)
    _assert_clean(model_work, p)
    argv = ["train", "--model-module", target, "--data", data, "--steps", 2, "--batch-size", 256, "--eval-every", 0]
    p = _tpurec(*argv, "--keep", 0, "--curves-out", "none", "--quiet", cwd=model_work, env=env)
    _assert_clean(model_work, p)
    assert json.loads(p.stdout.splitlines()[-1])["steps"] == 2


@pytest.mark.slow  # 13 s; the default suite covers the ranks' path by test_train_nproc_2
@pytest.mark.multiprocess
def test_train_nproc_2_of_a_model_file(model_work, tmp_path):
    data = tmp_path / "data"
    env = _env(TPUREC_CACHE=str(tmp_path / "cache"))
    p = _tpurec(
        "data",
        "synth",
        "--model-module",
        "./my_model.py:build",
        "--rows",
        2000,
        "--out",
        data,
        "--quiet",
        cwd=model_work,
        env=env,
    )
    _assert_clean(model_work, p)
    argv = ["train", "--model-module", "./my_model.py:build", "--data", data, "--nproc", 2, "--steps", 2]
    p = _tpurec(
        *argv,
        "--batch-size",
        256,
        "--eval-every",
        0,
        "--keep",
        0,
        "--curves-out",
        "none",
        "--quiet",
        cwd=model_work,
        env=env,
    )
    _assert_clean(model_work, p)
    assert json.loads(p.stdout.splitlines()[-1])["steps"] == 2
