"""The search's attention kernel (planner/search/kernel_choice.py): the pin, else the kernel the GPU
kernel model prices faster without CP (flash under CP, on ties and on CPUs)."""
from __future__ import annotations

import dataclasses

import pytest

from cost_models.cluster import parse_cluster
from planner.errors import AutoparError
from planner.frontend.load import load_graph
from planner.search.candidates import facts_of
from planner.search.kernel_choice import AttentionChoice, attention_choice
from planner.search.pins import Pins
from planner.search.seq_lens import with_documents


@pytest.fixture(scope="module")
def llama1b():
    return load_graph("llama-1b", batch=1, seq_len=2048)


def _choice(graph, cluster, pinned=None):
    return attention_choice(graph, parse_cluster(cluster), facts_of(graph), "bf16", "eager", pinned)


def test_sdpa_without_cp_on_hopper_flash_under_cp(llama1b):
    """On an H100 SDPA's measured attention (HOPPER_ATTENTION's torch-sdpa) beats the Triton kernel's
    backward: layouts without CP run it; under CP, flash (SDPA's ring blocks are plain torch)."""
    got = _choice(llama1b, "dgx-h100")
    assert got == AttentionChoice("eager", "flash")
    assert got.of(1) == "eager" and got.of(2) == "flash" and got.of(8) == "flash"


def test_flash_on_cpus_on_ties_and_where_short_documents_favour_it(llama1b):
    assert _choice(llama1b, "local-cpu:2") == AttentionChoice("flash", "flash")
    assert _choice(llama1b, "dgx-a100-80g") == AttentionChoice("flash", "flash")  # no per-kernel factors: a tie
    short = with_documents(llama1b, {64: 32})  # 64-token documents: flash skips 31/32 of the masked work
    assert _choice(short, "dgx-h100") == AttentionChoice("flash", "flash")


def test_a_pin_holds_at_every_cp_and_a_model_without_flash_gets_eager(llama1b):
    assert _choice(llama1b, "dgx-h100", "flash") == AttentionChoice("flash", "flash")
    assert _choice(llama1b, "local-cpu:2", "eager") == AttentionChoice("eager", "eager")
    own = dataclasses.replace(llama1b, limits={"attention": "its own"})
    assert _choice(own, "dgx-h100") == AttentionChoice("eager", "eager")
    assert Pins.parse("attention=eager").choice == {"attention": "eager"}
    with pytest.raises(AutoparError, match="attention"):
        Pins.parse("attention=sdpa")


def test_the_plan_runs_the_chosen_kernel(llama1b):
    from planner.search.planning import plan_model

    plan, res = plan_model(llama1b, parse_cluster("dgx-h100:1"), 8, spec="llama-1b", cluster_spec="dgx-h100:1")
    assert res.best.config.cp == 1 and res.best.config.attention == "eager"
    plan, res = plan_model(llama1b, parse_cluster("dgx-h100:1"), 8, spec="llama-1b", cluster_spec="dgx-h100:1",
                           fix="attention=flash")
    assert res.best.config.attention == "flash"
