"""The search: from a ModelGraph, a cluster and a batch to the chosen configuration and its Plan.

It owns the enumeration of layouts (``candidates``: degree tuples, micro-batch sizes, variants,
each level pruned by the feasibility predicate's own part) and their pricing (``space``: floors,
the winner), the stage split (``stage_split`` builds the ILP's inputs from the cost model,
``partition`` / ``partition_problem`` / ``partition_greedy`` solve it with PuLP), the user's pins
(``pins``, ``autopar plan --fix``), packed-document inputs (``seq_lens``) and ``planning``, which turns
the winner into the Plan file (``autopar plan``, ``autopar evaluate``). What can run is the contract
layer's one predicate (``planner/feasibility.py``); what a layout costs is ``cost_models``'. It reads the
contracts, the front end and the cost models; nothing of the runtime or the entry points.
"""
