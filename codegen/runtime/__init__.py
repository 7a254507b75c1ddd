"""What emitted training programs import: one module per concern.

- ``mesh``: ``init_distributed``, ``build_mesh`` (dims pp, dp, cp, tp), ``teardown``
- ``tensor_parallel``: ``apply_tp`` from the plan's ``{fqn: role}`` layout (DTensor)
- ``context_parallel``: ring attention with zigzag sequence sharding
- ``pipeline_parallel``: FQN-preserving stage modules and torch pipelining schedules
- ``data_parallel``: FSDP2 / replicate / ZeRO-1 over dp x cp
- ``recompute``: full (per block) and selective (attention core) checkpointing
- ``checkpoint``: DCP save / ``load_latest`` with an atomic ``latest`` marker
- ``train``: ``parallelize(...) -> ParallelModel`` with ``step(batch) -> loss``

Modules are imported on demand (``from codegen.runtime.train import parallelize``).
"""
