"""What a backward split into I and W costs (cost_models.pipeline.SplitCost): the simulator,
the closed form, the generator and the estimate price it alike."""
import pytest

from cost_models.pipeline import SplitCost, estimate_step, simulate, simulate_schedule
from planner.schedule_file import parse_csv
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


def test_the_first_stage_backward_runs_in_w_under_torch():
    from planner.schedule_check import frees, peak_activations
    p, m, f, b = 4, 8, [1.0] * 4, [2.0] * 4
    i, w = SplitCost(extra=0.1, first_whole=True).parts([2.0, 4.0])
    assert (i[0], w[0]) == (0.0, 2.0) and i[1] + w[1] == pytest.approx(4.4)
    res = simulate("zb-h1", p, m, f, b, split=SplitCost(first_whole=True))
    on0 = [e for e in res.events if e.stage == 0]
    assert all(e.end == e.start for e in on0 if e.kind == "I")
    assert all(e.end - e.start == pytest.approx(2.0) for e in on0 if e.kind == "W")
    assert sum(res.busy_s) == pytest.approx(m * (sum(f) + sum(b)))
    for pp, mm in ((2, 4), (4, 8), (8, 32)):  # uniform stages: the textbook split's step, the closed form's (which
        torch = SplitCost(first_whole=True)  # charges the first stage the extra too: an upper bound with one)
        assert simulate("zb-h1", pp, mm, 1.0, 2.0, split=torch).step_s == pytest.approx(
            estimate_step("zb-h1", pp, mm, 1.0, 2.0, split=torch))
        dear = SplitCost(0.1, first_whole=True)
        assert simulate("zb-h1", pp, mm, 1.0, 2.0, split=dear).step_s <= estimate_step("zb-h1", pp, mm, 1.0, 2.0,
                                                                                         split=dear) + 1e-9
    # its activations are freed by its W, every other stage's by its I
    assert (frees("I", 0), frees("W", 0), frees("I", 1), frees("W", 1), frees("B", 0)) == (False, True, True, False, True)
    s = parse_csv("0F0,0F1,0I0,0W0,0I1,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n")
    assert peak_activations(s, [1.0, 1.0]) == [2.0, 1.0]
    late = parse_csv("0F0,0F1,0I0,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n")
    assert peak_activations(late, [1.0, 1.0]) == [2.0, 1.0]
    ahead = parse_csv("0F0,0I0,0F1,0I1,0W0,0W1\n1F0,1I0,1F1,1I1,1W0,1W1\n")
    assert peak_activations(ahead, [1.0, 1.0]) == [2.0, 1.0]  # (0I0 frees nothing: 0F1 makes two)


def test_the_generator_plans_with_the_split_cost():
    from planner.search.schedule_gen import best_schedule, generate
    f, b = [1.0] * 4, [2.0] * 4
    dear = SplitCost(extra=1.0)  # splitting doubles a backward: no split pays
    choice = best_schedule(f, b, 8, split=dear)
    assert choice.name == "1f1b", choice.name
    f, b = [1.0] * 4 + [0.3] * 4, [2.0] * 4 + [0.6] * 4  # the head as passes: the generator splits backwards
    gen = generate(f, b, 8, stage_rank=looped(4, 2), split=dear)
    split = [a for r in range(gen.p) for a in gen.actions(r) if a.kind == "W"]
    assert split and not [a for a in split if a.stage == 0]  # (the first stage runs whole)
    assert simulate_schedule(gen, f, b, split=dear).step_s > simulate_schedule(gen, f, b).step_s  # and pays for it


def test_the_estimate_prices_the_cpu_runtimes_split():
    from cost_models.cluster import parse_cluster
    from cost_models.cpu_runtime import DEFAULTS
    from cost_models.estimate import estimate, split_cost
    from planner.frontend.load import load_graph
    from planner.plan import ParallelConfig, Partition

    cpu, gpu = parse_cluster("local-cpu:4"), parse_cluster("dgx-h100:1")
    assert split_cost(cpu) == SplitCost(extra=DEFAULTS["split_backward_frac"], first_whole=True)
    assert split_cost(gpu) == SplitCost(first_whole=True)

    class Measured:
        runtime = {"split_backward_frac": 0.3}
        calibration: dict = {}
    assert split_cost(gpu, Measured()).extra == 0.3 and split_cost(cpu, Measured()).extra == 0.3
    g = load_graph("gpt-tiny", batch=1)
    part = Partition.even(len(g.layers), 4, "none")
    zb, one = (estimate(g, cpu, ParallelConfig(pp=4, schedule=s).validate(), part, 8) for s in ("zb-h1", "1f1b"))
    assert zb.split == split_cost(cpu) and zb.to_dict()["split_backward"]["extra"] == DEFAULTS["split_backward_frac"]
    assert zb.pipeline is not None and sum(zb.pipeline.busy_s) > sum(one.pipeline.busy_s)
