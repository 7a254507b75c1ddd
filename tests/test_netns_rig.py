"""The two-region rig (planner/entry/netns_rig.py): real namespaces, a real tbf-limited veth,
real gloo ranks. Skipped, with the reason, where namespaces cannot be made."""
import json
import os
import subprocess

import pytest

from planner.entry.launch import rig_spec
from planner.entry.netns_rig import Rig, RigSpec, launch_across, rig_problem
from planner.errors import AutoparError
from tests.launches import ROOT

PROBLEM = rig_problem()
needs_rig = pytest.mark.skipif(PROBLEM is not None, reason=f"no two-region rig here: {PROBLEM}")


def test_bad_rigs_are_refused_in_one_line():
    for bad, words in ((lambda: RigSpec(nproc=0), "at least one rank"),
                       (lambda: RigSpec(rate_mbit=-5), "positive rate"),
                       (lambda: rig_spec(3, 100.0), "even number")):
        with pytest.raises(AutoparError, match=words) as e:
            bad()
        assert "\n" not in str(e.value)
    assert rig_spec(4, None) is None


@pytest.mark.slow
@needs_rig
def test_rig_limits_only_the_traffic_that_crosses(tmp_path):
    out = tmp_path / "rig.json"
    rate = 100.0
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    with Rig(RigSpec(nproc=2, rate_mbit=rate)) as rig:
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        assert rig.ns(0) in names and rig.ns(1) in names
        run = launch_across(rig, [os.path.join(ROOT, "tests", "rig_worker.py"), str(out)], env, timeout_s=120)
    assert run.rc == 0
    assert rig.ns(0) not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    got = json.loads(out.read_text())
    assert 0.5 * rate < got["across_mbit"] < 1.2 * rate, got   # the tbf rate (a 4 MiB send is 30 buckets)
    assert got["within_mbit"] > 5 * rate, got                   # ranks of one region do not cross the link


@pytest.mark.slow
@needs_rig
def test_a_plan_trains_the_same_on_the_rig(tmp_path):
    """llama-tiny dp4 (its gradient all-reduce crosses the cut): the same losses at 50 Mbit/s
    across the rig as on one machine's loopback."""
    from planner.entry.launch import run_plan
    from planner.frontend.load import load_graph
    from cost_models.cluster import parse_cluster
    from planner.files import write_atomic
    from planner.report.data import load_run_log
    from planner.search.planning import plan_model

    g = load_graph("llama-tiny", batch=1)
    plan, _ = plan_model(g, parse_cluster("local-cpu:4"), 8, spec="llama-tiny", cluster_spec="local-cpu:4",
                         fix="dp=4,pp=1,tp=1,cp=1")
    path = str(tmp_path / "plan.json")
    write_atomic(path, plan.to_json(), force=True)
    losses = {}
    for name, mbit in (("local", None), ("rig", 50.0)):
        rc, log = run_plan(path, steps=3, run_dir=str(tmp_path / name), rig_mbit=mbit, timeout_s=180)
        assert rc == 0
        losses[name] = [r["loss"] for r in load_run_log(log)]
    assert len(losses["rig"]) == 3 and losses["rig"] == losses["local"]
