"""Cost models: what a configuration costs, estimation only (no torch.distributed, no launching).

It owns the cluster contract (``cluster``), compute (``compute``, ``gpu_kernels``, ``shared_cores``),
communication (``comm``, ``context_parallel``, ``experts``), per-rank memory (``memory``, ``pipeline_memory``,
``op_recompute``), the pipeline schedule simulator (``pipeline``), packed documents (``documents``),
their composition into a step estimate (``estimate``) and the measurements that feed them
(``profile_db``, ``profiler``, ``calibrate``). It reads the contracts only; the profiler alone runs the
runtime's own layers, so that it measures what training runs.
"""
