"""The forced layouts ``benchmarks/fidelity.py`` runs beside the planner's picks, per model kind
and world size (those that do not fit, that the planner's structural checks reject or that
repeat a search candidate are skipped there)."""
from __future__ import annotations

# Forced layouts per model kind and world size (those that do not fit, that the planner's
# structural checks reject or that repeat a search candidate are skipped). world = 4:
FORCED = {
    "gpt": [
        "dp=4,zero=zero1,mbs=2",
        "dp=4,zero=fsdp,mbs=2",
        "dp=2,tp=2,sp=on,zero=zero1,mbs=4",
        "tp=4,sp=on,mbs=8",
        "dp=2,cp=2,zero=zero1,mbs=4",
    ],
    "llama": [
        "pp=2,dp=2,schedule=1f1b,mbs=1,zero=zero1",
        "pp=2,dp=2,schedule=gpipe,mbs=1,zero=zero1",
        "pp=4,schedule=1f1b,mbs=1",
        "pp=2,tp=2,sp=on,schedule=1f1b,mbs=2",
        "pp=2,dp=2,schedule=interleaved-1f1b,vpp=2,mbs=1,zero=zero1",
        "dp=4,zero=zero1,mbs=2",
        "dp=2,tp=2,sp=on,zero=zero1,mbs=4",
    ],
    "tiny": [
        "pp=2,schedule=1f1b",
        "tp=2,sp=on",
        "dp=2,zero=zero1",
    ],
    "moe": [
        "dp=4,ep=4,zero=fsdp,mbs=2",
        "dp=2,tp=2,sp=on,ep=4,zero=fsdp,mbs=4",
        "dp=4,ep=2,zero=fsdp,mbs=2",
        "dp=4,zero=zero1,mbs=2",
    ],
}
# fewer processes than the cluster's, more threads each (ParallelConfig.threads): on 2 cores two
# single-thread ranks and one process with both threads, beside the 4-rank layouts above
for _kind_name, _extra in (("gpt", ["dp=2,zero=zero1,mbs=4", "threads=2,mbs=8"]),
                           ("llama", ["dp=2,zero=zero1,mbs=4", "threads=2,mbs=8"])):
    FORCED[_kind_name] = FORCED[_kind_name] + _extra

# world = 2: every mesh dimension alone, the schedules and the DP sharding modes.
FORCED_2 = {
    "gpt": [
        "dp=2,zero=zero1,mbs=4",
        "dp=2,zero=fsdp,mbs=4",
        "tp=2,sp=on,mbs=8",
        "cp=2,mbs=8",
        "pp=2,schedule=1f1b,mbs=2",
    ],
    "llama": [
        "dp=2,zero=ddp,mbs=4",
        "dp=2,zero=zero1,mbs=4",
        "tp=2,sp=on,mbs=8",
        "cp=2,mbs=8",
        "pp=2,schedule=1f1b,mbs=1",
        "pp=2,schedule=gpipe,mbs=1",
        "pp=2,schedule=zb-h1,mbs=2",
    ],
    "tiny": ["pp=2,schedule=1f1b", "tp=2,sp=on", "dp=2,zero=zero1"],
    "moe": ["dp=2,ep=2,zero=fsdp,mbs=4", "tp=2,sp=on,ep=2,mbs=8", "dp=2,zero=zero1,mbs=4", "pp=2,schedule=1f1b,mbs=2",
            "threads=2,mbs=8"],
}
for _kind_name in ("gpt", "llama"):  # one process with both cores' threads
    FORCED_2[_kind_name] = FORCED_2[_kind_name] + ["threads=2,mbs=8"]
FORCED_BY_WORLD = {4: FORCED, 2: FORCED_2}
