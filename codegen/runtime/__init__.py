"""What emitted training programs import: one module per concern.

- ``mesh``: ``init_distributed``, ``build_mesh`` (dims pp, dp, cp, tp), ``teardown``
- ``tensor_parallel``: ``apply_tp`` from the plan's ``{fqn: role}`` layout (DTensor)
- ``tp_plan``: ``tp_plan_for``, the per-block TP plan (``BLOCK_TP_PLAN``) and the other
  modules' (``TP_PLAN``) expanded to that layout
- ``context_parallel``: ring attention with zigzag sequence sharding
- ``pipeline_parallel``: FQN-preserving stage modules and the schedule IR run by torch's schedule runtime
- ``data_parallel``: FSDP2 / replicate / ZeRO-1 over dp x cp
- ``recompute``: full (per block) and selective (attention core) checkpointing
- ``checkpoint``: DCP save / ``load_latest`` with an atomic ``latest`` marker
- ``recipe``: the parallelisation steps, one helper per concern, in order (``check_runnable``,
  ``split_stages``, ``materialize``, ``tie_weights``, ``apply_attention``, ``apply_tp``,
  ``apply_recompute``, ``apply_dp``, ``build_schedule``)
- ``optim``: one optimizer per stage module, the warmup + cosine learning rate, gradient
  clipping by the global norm (DTensor shards, pipeline ranks)
- ``train``: ``ParallelModel`` (the training step and its parts) and ``parallelize(...)``, the
  recipe in one call

Modules are imported on demand (``from codegen.runtime.train import parallelize``).
"""
