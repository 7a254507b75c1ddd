"""What a backward split into I and W costs (cost_models.pipeline.SplitCost): the simulator,
the closed form, the generator and the estimate price it alike."""
import pytest

from cost_models.pipeline import SplitCost, estimate_step, simulate, simulate_schedule
from planner.schedule_ir import builtin, looped


def test_parts_scale_the_split():
    i, w = SplitCost().parts([2.0, 4.0])
    assert (i, w) == ([1.0, 2.0], [1.0, 2.0])
    i, w = SplitCost(extra=0.1).parts([2.0, 4.0], [0.5, 1.0])
    assert i == pytest.approx([1.65, 3.3]) and w == pytest.approx([0.55, 1.1])


def test_a_split_schedule_pays_the_extra_and_a_whole_backward_does_not():
    p, m, f, b = 4, 8, [1.0] * 4, [2.0] * 4
    base, dear = SplitCost(), SplitCost(extra=0.25)
    zb0, zb1 = (simulate("zb-h1", p, m, f, b, split=s) for s in (base, dear))
    assert zb1.step_s > zb0.step_s and sum(zb1.busy_s) == pytest.approx(sum(zb0.busy_s) + 0.25 * m * sum(b))
    one0, one1 = (simulate("1f1b", p, m, f, b, split=s).step_s for s in (base, dear))
    assert one0 == one1  # B runs whole: nothing to pay
    ir = builtin("zb-h1", p, m)
    assert simulate_schedule(ir, f, b, split=dear).step_s == pytest.approx(zb1.step_s, rel=1e-12)
    assert estimate_step("zb-h1", p, m, f, b, split=dear) >= zb1.step_s - 1e-9  # still an upper bound


def test_the_generator_plans_with_the_split_cost():
    from planner.search.schedule_gen import best_schedule, generate
    f, b = [1.0] * 4, [2.0] * 4
    dear = SplitCost(extra=1.0)  # splitting doubles a backward: no split pays
    choice = best_schedule(f, b, 8, split=dear)
    assert choice.name == "1f1b", choice.name
    gen = generate([1.0] * 4 + [0.3] * 4, [2.0] * 4 + [0.6] * 4, 8, stage_rank=looped(4, 2), split=dear)
    assert simulate_schedule(gen, [1.0] * 4 + [0.3] * 4, [2.0] * 4 + [0.6] * 4, split=dear).step_s > 0


def test_the_estimate_prices_the_cpu_runtimes_split():
    from cost_models.cluster import parse_cluster
    from cost_models.cpu_runtime import DEFAULTS
    from cost_models.estimate import estimate, split_cost
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig, Partition

    cpu, gpu = parse_cluster("local-cpu:4"), parse_cluster("dgx-h100:1")
    assert split_cost(cpu) == SplitCost(extra=DEFAULTS["split_backward_frac"]) and split_cost(gpu) == SplitCost()

    class Measured:
        runtime = {"split_backward_frac": 0.3}
        calibration: dict = {}
    assert split_cost(gpu, Measured()).extra == 0.3 and split_cost(cpu, Measured()).extra == 0.3
    g = load_graph("gpt-tiny", batch=1)
    part = Partition.even(len(g.layers), 4, "none")
    zb, one = (estimate(g, cpu, ParallelConfig(pp=4, schedule=s).validate(), part, 8) for s in ("zb-h1", "1f1b"))
    assert zb.split == split_cost(cpu) and zb.to_dict()["split_backward"]["extra"] == DEFAULTS["split_backward_frac"]
    assert zb.pipeline is not None and sum(zb.pipeline.busy_s) > sum(one.pipeline.busy_s)
