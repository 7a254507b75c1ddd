"""From a Plan to a running program: ``emit`` writes the standalone torchrun program; ``runtime``
holds the helpers that program (and ``auto_parallelize``) calls, one per parallelism, and the model
adapters; ``kernels`` holds the Triton kernels with their torch fallbacks. It reads the plan contract
and its own modules, never the planner's search or the cost models.
"""
