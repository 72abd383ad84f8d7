"""A plan's topology against the run's (#61 item 6): a cpu-1 plan puts every table on rank 0, a rank
that exists in any world, so it ran on 2 or 4 ranks and on an emulated v5p-8 with the other ranks
idle, without a word. The plan file says how many devices it was planned for; another count is
refused in one line naming the file, both counts and the fix."""

from __future__ import annotations

import pytest

from tpurec import cli
from tpurec.errors import UserError


@pytest.fixture(scope="module")
def cpu1_plan(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "p1.json"
    argv = ["plan", "--model", "dlrm-tiny", "--topology", "cpu-1", "--format", "json", "--out", str(path)]
    assert cli.main(argv) == 0
    return path


def _tables():
    from tpurec.dlrm.configs import get_config
    from tpurec.dlrm.model import build_model
    from tpurec.planner.plan_check import embedding_tables

    return embedding_tables(build_model(get_config("dlrm-tiny")))


@pytest.mark.parametrize("world,slice_name", [(2, None), (4, None), (4, "v5p-8")])
def test_a_cpu_1_plan_is_refused_on_more_ranks(cpu1_plan, world, slice_name):
    from tpurec.dlrm.preflight import check_plan_file

    with pytest.raises(UserError) as e:
        check_plan_file(str(cpu1_plan), _tables(), world, slice_name)
    assert str(e.value) == (
        f"--plan {cpu1_plan} was planned for cpu-1, 1 device(s), but this run has {world}: plan for the devices "
        f"you run (tpurec plan --topology ...; cpu-{world} for {world} CPU ranks)"
    )


def test_the_plan_runs_where_it_was_planned(cpu1_plan):
    from tpurec.dlrm.preflight import check_plan_file

    check_plan_file(str(cpu1_plan), _tables(), 1, None)  # no error


def test_the_planned_world_of_reports_and_saved_plans():
    from tpurec.planner.plan_check import planned_world_size

    assert planned_world_size({"world_size": 8, "meta": {"topology": "v5p-16"}}) == 8
    assert planned_world_size({"format": "tpurec-plan", "meta": {"topology": "v5p-8"}}) == 4
    assert planned_world_size({"format": "tpurec-plan", "meta": {"topology": "cpu-3"}}) == 3
    assert planned_world_size({"format": "tpurec-plan", "meta": {"topology": "no-such"}}) is None
    assert planned_world_size({"format": "tpurec-plan", "meta": {}}) is None
