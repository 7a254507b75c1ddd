"""FSDP2 mixed precision's per-micro-batch copies on GPUs (cost_models/mp_casts.py): the bytes
each wrapper moves, where they are paid, and who pays none."""
from __future__ import annotations

import pytest

from cost_models import gpu_kernels as gk
from cost_models.cluster import parse_cluster
from cost_models.engines import ENGINES, DEFAULT_ENGINE
from cost_models.memory import layer_params_local
from cost_models.mp_casts import KERNELS_PER_PASS, MpCasts, layer_mp_casts, stage_mp_casts
from planner.frontend.load import load_graph
from planner.plan import ParallelConfig, Partition

GPU = parse_cluster("dgx-h100")


@pytest.fixture(scope="module")
def graph():
    return load_graph("llama-tiny", seq_len=64)


def _block(graph):
    return next(l for l in graph.layers if l.kind == "transformer_block")


def _mem(nbytes: float) -> float:
    return gk.memory_seconds(nbytes, KERNELS_PER_PASS, gk.gpu_spec(GPU, "bf16"), gk.GpuCoefficients())


def test_one_rank_unshards_twice_and_accumulates_whole_gradients(graph):
    """dp1 pp1 (fully_shard on one mixed-precision rank reshards after the forward): each call
    casts and copies the unit (6 + 4 bytes per parameter) for the forward and again for the
    backward; with ddp the backward adds the whole gradient into its fp32 accumulator in place
    (10: the sync is off but for the last micro-batch), with fsdp it casts the whole gradient for
    the reduce-scatter (6) and adds the reduced shard, here the whole unit (12)."""
    b = _block(graph)
    P = layer_params_local(b, 1)
    c = layer_mp_casts(b, graph, ParallelConfig(mbs=1), 4, GPU, None, DEFAULT_ENGINE)
    assert c.per_call_fwd == pytest.approx(_mem(10 * P)) and c.per_microbatch_fwd == 0.0
    assert c.per_call_bwd == pytest.approx(_mem(10 * P) + _mem(10 * P))
    assert c.per_microbatch_bwd == pytest.approx(_mem(8 * P + 12 * P) / 4)  # the step's one reduction, per micro-batch
    one = layer_mp_casts(b, graph, ParallelConfig(mbs=1), 1, GPU, None, DEFAULT_ENGINE)  # one micro-batch reduces at once
    assert one.per_call_bwd == pytest.approx(_mem(10 * P) + _mem(18 * P)) and one.per_microbatch_bwd == 0.0
    f = layer_mp_casts(b, graph, ParallelConfig(mbs=1, zero="fsdp"), 4, GPU, None, DEFAULT_ENGINE)
    assert f.per_call_bwd == pytest.approx(_mem(10 * P) + _mem(18 * P))


def test_sharded_and_replicated_data_parallelism(graph):
    """FSDP over 8: the cast reads its shard, the copy-out and the gradient cast the whole unit,
    the add keeps the shard; replicate (zero1) keeps everything whole, does not re-gather and adds
    each call's gradient into its fp32 accumulator in place (10 bytes per parameter)."""
    b = _block(graph)
    P = layer_params_local(b, 2)
    fsdp = layer_mp_casts(b, graph, ParallelConfig(dp=8, tp=2, zero="fsdp"), 4, GPU, None, DEFAULT_ENGINE)
    assert fsdp.per_call_fwd == pytest.approx(_mem(6 * P / 8 + 4 * P))
    assert fsdp.per_call_bwd == pytest.approx(fsdp.per_call_fwd + _mem(6 * P + 12 * P / 8))
    rep = layer_mp_casts(b, graph, ParallelConfig(dp=8, tp=2, zero="zero1"), 4, GPU, None, DEFAULT_ENGINE)
    assert rep.per_call_fwd == pytest.approx(_mem(10 * P)) and rep.per_call_bwd == pytest.approx(_mem(10 * P))


def test_a_pipeline_unshards_once_per_step(graph):
    b = _block(graph)
    P = layer_params_local(b, 1, pp=2)
    c = layer_mp_casts(b, graph, ParallelConfig(pp=2, dp=2, zero="fsdp", schedule="1f1b"), 8, GPU, None,
                       DEFAULT_ENGINE)
    assert c.per_call_fwd == 0.0 and c.per_microbatch_fwd == pytest.approx(_mem(6 * P / 2 + 4 * P) / 8)
    assert c.per_call_bwd == pytest.approx(_mem(10 * P))  # added whole, in place, until the last micro-batch
    assert c.per_microbatch_bwd == pytest.approx(_mem(8 * P + 12 * P / 2) / 8) and c.bwd > c.per_call_bwd


def test_who_pays_none(graph):
    b = _block(graph)
    cfg = ParallelConfig(dp=8, zero="fsdp")
    assert layer_mp_casts(b, graph, cfg, 1, GPU, None, ENGINES["megatron-core"]) == MpCasts()
    assert layer_mp_casts(b, graph, cfg.replace(dtype="fp32"), 1, GPU, None, DEFAULT_ENGINE) == MpCasts()
    assert layer_mp_casts(b, graph, cfg, 1, parse_cluster("local-cpu:2"), None, DEFAULT_ENGINE) == MpCasts()
    assert layer_mp_casts(b, graph, cfg, 1, GPU, None, ENGINES["torchtitan"]) != MpCasts()


def test_the_estimate_charges_them_per_micro_batch_as_runtime_work(graph):
    """The breakdown's ``runtime`` on a GPU is the stages' copies times the micro-batches."""
    from cost_models.estimate import estimate

    cfg = ParallelConfig(dp=8, zero="fsdp", mbs=1)
    part = Partition.even(len(graph.layers), 1, "none")
    e = estimate(graph, GPU, cfg, part, 32)
    mp = stage_mp_casts(graph, cfg, 0, len(graph.layers), 4, GPU, None, DEFAULT_ENGINE)
    assert e.breakdown["runtime"] == pytest.approx(4 * (mp.fwd + mp.bwd))
    off = estimate(graph, GPU, cfg, part, 32, engine="megatron-core")
    assert "runtime" not in off.breakdown


def test_every_sequence_chunk_pays_the_per_call_copies(graph):
    """Each chunk is a forward and a backward call: the gradients' cast and add are in the fixed part
    every chunk pays whole; the pipeline's once-per-step unshard is not."""
    from cost_models.layer_costs import LayerCosts
    from cost_models.seq_chunks import stage_chunk_parts
    from planner.search.stage_split import even_split

    cfg = ParallelConfig(pp=2, dp=4, zero="fsdp", schedule="1f1b", seq_chunks=4)
    part = even_split(graph, 2)
    parts = stage_chunk_parts(graph, part, LayerCosts(graph, GPU, cfg, None), cfg, 4)
    for j, (lo, hi) in enumerate(part.bounds):
        mp = stage_mp_casts(graph, cfg, lo, hi, 4, GPU, None, DEFAULT_ENGINE)
        assert mp.per_call_bwd > 0 and parts.fixed_bwd[j] == pytest.approx(mp.per_call_bwd)
        assert parts.fixed_fwd[j] == pytest.approx(mp.per_call_fwd) == 0.0


def test_the_search_floor_takes_the_least_sharding_per_rank(graph):
    """``least_mp_casts`` (the search's time floors): at most what any DP sharding pays, over the pp ranks."""
    from cost_models.mp_casts import least_mp_casts
    from planner.sharding import ZERO

    for cfg in (ParallelConfig(dp=4, pp=2, schedule="1f1b"), ParallelConfig(dp=8)):
        least = least_mp_casts(graph, cfg, 8, GPU, None, DEFAULT_ENGINE)
        each = [stage_mp_casts(graph, cfg.replace(zero=z), 0, len(graph.layers), 8, GPU, None, DEFAULT_ENGINE)
                for z in ZERO]
        assert least.fwd + least.bwd == pytest.approx(min(c.fwd + c.bwd for c in each) / cfg.pp)
        assert least.fwd + least.bwd > 0
