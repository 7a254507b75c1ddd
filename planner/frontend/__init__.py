"""The front end: from a model to the ModelGraph the planner reads.

It owns capture (``trace``: one forward and backward on fake tensors, recorded per layer unit and
traced into an ATen-level FX graph by ``fx_graph``; ``records`` assembles the layers; ``layer_kinds``
names what each part is), the tensor-parallel dataflow analysis of the FX graph (``tp_analysis``) and
the layout it yields (``tp_layout``), and ``load``: the one door from a model spec or an ``nn.Module``
to a ModelGraph annotated with what the runtime can run for it (the model's adapter in
``codegen/runtime/adapters`` names its units and limits). It reads the contracts, the zoo and the
runtime's adapters; nothing of the cost models, the search or the entry points.
"""
