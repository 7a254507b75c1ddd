"""ModelGraph: the intermediate representation every later stage reads.

A ModelGraph describes one training step of a model at one example shape
(``batch`` sequences of ``seq_len`` tokens) as an ordered list of *layers*: the
units a pipeline stage boundary may fall between (embedding, each transformer
block, final norm, head + loss, vision blocks, projector, ...). Within a layer,
``ops`` summarise the parts that tensor parallelism treats differently
(attention, MLP, norm, linear, embedding, loss).

This module is a leaf contract: it imports nothing from torch or from the rest of
autopar, so a plan, a report or a cost model can read a ModelGraph from JSON
without torch installed.

Units, everywhere below:
- FLOPs: floating-point operations for the whole captured batch
  (a multiply-add counts as 2), the convention of ``torch.utils.flop_counter``.
- bytes: bytes for the whole captured batch at the captured dtype.
- Per-sequence figures are the batch figures divided by ``batch``; FLOPs and
  activations are linear in the batch, so cost models rescale by micro-batch size.

Activation bytes are split by how parallelism divides them:
- ``act_bytes_tp``: saved tensors that carry a dimension TP splits (heads, FFN
  width, vocabulary); divided by tp.
- ``act_bytes_attn_core``: the part of ``act_bytes_tp`` that selective recompute
  drops (tensors with a sequence x sequence shape inside the attention core).
- the rest (``act_bytes - act_bytes_tp``): hidden-sized tensors (norm inputs,
  residuals, inputs of column-parallel linears) that TP alone replicates and
  sequence parallel divides by tp.
Context parallelism divides all of them by cp (every saved tensor carries the
sequence dimension, except attention-core tensors whose S x S area shrinks by cp
as each rank holds S/cp queries).

``documents`` (a :class:`DocumentMix`, a planning input like ``MoEDims.imbalance``) says that
each sequence of ``seq_len`` tokens is a row of packed documents whose attention never
crosses a document boundary; the FLOPs above stay those of the capture (one document
filling the row), and the cost models scale the attention core by the mix.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from typing import Any

GRAPH_SCHEMA_VERSION = 2

LAYER_KINDS = (
    "embedding", "transformer_block", "vision_block", "vision_embedding", "projector",
    "norm", "head", "loss", "other",
)
# The repeated blocks of a model (what a pipeline stage balances, what TP analysis studies).
BLOCK_KINDS = ("transformer_block", "vision_block")
OP_KINDS = ("attention", "mlp", "norm", "linear", "embedding", "loss", "other")
# How tensor parallelism treats an op (see cost_models/compute.py and codegen's TP plan):
#   heads      attention split by heads (q/k/v column-, output row-parallel)
#   col_row    a column-parallel linear feeding a row-parallel one (MLP)
#   vocab      vocabulary-parallel embedding / head / loss
#   replicated computed in full on every tp rank (norms; sharded by sequence under SP)
TP_STYLES = ("heads", "col_row", "vocab", "replicated")
# Linear.role values whose output features tensor parallelism splits, and all it splits (row: input)
OUT_SPLIT_ROLES = ("column", "packed_qkv", "vocab")
TP_SPLIT_ROLES = OUT_SPLIT_ROLES + ("row",)
# Per-op recompute (``selective-op``): the ATen ops it alternates on, and which of them it keeps;
# the one rule the runtime's save policy (codegen/runtime/recompute.py) and the cost model (on the
# captured ``Layer.matmuls``, cost_models/op_recompute.py) both apply.
MATMUL_OPS = ("mm", "addmm")


def keeps_matmul(index: int) -> bool:
    """Whether per-op recompute keeps the output of the ``index``-th (0-based) ``MATMUL_OPS`` call
    of one forward of a checkpointed block: the 1st, 3rd, 5th ..."""
    return index % 2 == 0


@dataclass
class Matmul:
    """One ``MATMUL_OPS`` call of a layer's forward, in call order (capture records them)."""
    linear: str             # the Linear (path relative to the layer) that ran it; "" for a bare matmul
    out_elems: float        # output elements for the captured batch
    flops: float            # forward FLOPs for the captured batch


@dataclass
class Linear:
    """One nn.Linear inside a layer, with the TP role the runtime gives it."""
    name: str               # path relative to the layer, e.g. "attn.q_proj"
    in_features: int
    out_features: int
    bias: bool
    role: str               # "column" | "row" | "packed_qkv" | "vocab" | "replicated" (planner/frontend/tp_layout.py)


@dataclass
class AttentionDims:
    heads: int
    kv_heads: int
    head_dim: int
    seq_len: int            # query length at capture
    kv_len: int
    causal: bool


@dataclass
class MoEDims:
    """A mixture-of-experts MLP: ``experts`` routed SwiGLU experts (hidden -> ``expert_ffn`` ->
    hidden), ``top_k`` per token, plus ``shared_experts`` every token passes (part ``part``)."""
    experts: int
    top_k: int
    expert_ffn: int
    shared_experts: int
    part: str               # the op (relative module path) holding the experts, e.g. "mlp"
    imbalance: float = 1.0  # tokens the busiest expert-parallel rank gets over the mean (a planning input)
    act_bytes: float = 0.0  # saved for backward inside ``part`` (router, dispatch, experts, combine), captured batch

    def expert_params(self, hidden: int) -> int:
        """Parameters of the routed experts (gate, up, down of each): 3 x experts x hidden x expert_ffn."""
        return 3 * self.experts * hidden * self.expert_ffn


@dataclass(frozen=True)
class DocumentMix:
    """Packed documents in the micro-batch rows of ``seq_len`` tokens (``autopar plan --seq-lens``;
    cost_models/documents.py computes it). Concatenate-and-split packing: documents (longer
    ones first cut into ``seq_len`` pieces) follow each other in a shuffled order, and one
    that crosses a row end continues as a new document in the next row; attention is
    causal within each document (document masks). Lengths are in tokens.

    ``attention_share``: the mean over rows of sum(L_i^2) / seq_len^2, the causal attention
    work of a packed row relative to one document filling it (1.0: no saving);
    ``mean_tokens``: the token-weighted mean document length in the rows, sum(L_i^2) /
    sum(L_i) (the keys a query's kernel sees, where the capture assumed ``seq_len``);
    ``pieces``: the simulated rows' documents in order, ``rows`` rows of ``seq_len`` tokens
    each (row ends fall on multiples of ``seq_len`` of the running sum), from which the
    cost model computes the share of the attention work a context-parallel ring's visiting
    blocks do. The rest describes the source for reports."""
    seq_len: int                  # the token budget of a row (the graph's seq_len)
    documents: int                # documents in the source
    tokens: int                   # tokens in the source
    median: int                   # document lengths in the source (by document count)
    p90: int
    longest: int
    cut: int                      # source documents longer than seq_len (cut into seq_len pieces)
    rows: int                     # rows simulated
    sampled: bool                 # the rows are a random sample of the source (it holds more)
    attention_share: float
    mean_tokens: float
    pieces: tuple[int, ...] = ()
    source: str = ""              # where the lengths came from (a file name)
    lengths: tuple[int, ...] = ()  # source lengths at evenly spaced count quantiles: what a synthetic run draws


@dataclass
class Op:
    """A part of a layer (attention, MLP, norm, ...)."""
    name: str               # relative module path ("" for the layer itself)
    kind: str               # one of OP_KINDS
    tp_style: str           # one of TP_STYLES
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    fwd_bytes: float = 0.0  # memory traffic of the forward (inputs + outputs of each aten op), bytes
    params: int = 0


@dataclass
class Layer:
    name: str               # module path, e.g. "layers.3"
    kind: str               # one of LAYER_KINDS
    module_type: str        # class name
    signature: str          # equal for structurally identical layers
    repeat_of: str | None   # name of the first layer with the same signature (None if this is it)
    fwd_flops: float        # FLOPs of the forward for the captured batch
    bwd_flops: float        # FLOPs of the backward (input and weight gradients)
    fwd_bytes: float        # memory traffic of the forward, bytes
    bwd_bytes: float        # memory traffic of the backward, bytes
    params: int             # parameters owned by this layer (tied weights counted at first use)
    param_bytes: int
    act_bytes: float        # saved for backward, bytes for the captured batch (each storage once)
    act_bytes_tp: float     # part of act_bytes divided by tp (see module docstring)
    act_bytes_attn_core: float  # part dropped by selective recompute
    input_bytes: float      # bytes of the layer's tensor inputs (what full recompute keeps)
    output_bytes: float     # bytes of the layer's tensor outputs (what a pipeline boundary sends)
    tp_flops_frac: float    # fraction of fwd/bwd FLOPs that TP divides (matmuls in heads/col_row/vocab ops)
    ops: list[Op] = field(default_factory=list)
    linears: list[Linear] = field(default_factory=list)
    attention: AttentionDims | None = None
    vocab: int | None = None
    tied_to: str | None = None  # "<layer>.<param>" when a parameter is shared with an earlier layer
    tied_params: int = 0        # elements of those shared parameters (a pipeline stage without the
                                # first owner holds its own copy)
    stage_start: bool = True    # a pipeline stage may begin at this layer (False: the runtime runs it
                                # with the layer before, e.g. a transformers model's embedding prologue)
    fwd_kernels: int = 0        # memory-bound ops (bytes moved, no FLOPs) of the forward / backward:
    bwd_kernels: int = 0        # the GPU cost model's per-kernel launch floor
    fwd_ops: int = 0            # tensor ops eager mode dispatches in the forward / backward (views
    bwd_ops: int = 0            # included): the CPU cost model's per-op dispatch cost
    moe: MoEDims | None = None  # routed experts (their GEMMs are not in ``linears``)
    matmuls: list[Matmul] = field(default_factory=list)  # the forward's MATMUL_OPS calls, in order

    def in_moe(self, path: str) -> bool:
        """Whether the module ``path`` (relative to this layer) lies inside its MoE part (router,
        shared and routed experts), which tensor parallelism leaves whole: under TP each rank
        runs it on its own sequence shard."""
        return self.moe is not None and bool(self.moe.part) and (path + ".").startswith(self.moe.part + ".")


def op_linears(op: Op, ops: list[Op], linears: list[Linear]) -> list[Linear]:
    """The linears (paths relative to the layer) inside ``op``: each belongs to the op of
    ``ops`` with the longest path holding it (the layer's own op ``""`` keeps those directly
    in the layer that no other op holds)."""
    def owner(lin: Linear) -> str:
        return max((o.name for o in ops if not o.name or lin.name == o.name or lin.name.startswith(o.name + ".")),
                   key=len, default="")
    return [lin for lin in linears if owner(lin) == op.name]


def op_tp_style(op: Op, ops: list[Op], linears: list[Linear]) -> str:
    """How tensor parallelism treats ``op``, read from its linears' roles (``Linear.role``, the
    one sharding spec: the front end's dataflow analysis overridden by the model's own TP plan):
    a vocabulary-parallel op stays ``vocab``; an op holding a linear TP splits is ``heads``
    (attention) or ``col_row``; one whose linears all stay whole is ``replicated``; an op
    without linears (a norm, an activation) keeps its captured style."""
    mine = op_linears(op, ops, linears)
    if op.tp_style == "vocab" or not mine:
        return op.tp_style
    if not any(lin.role in TP_SPLIT_ROLES for lin in mine):
        return "replicated"
    return "heads" if op.kind == "attention" else "col_row"


def tp_flops_frac(ops: list[Op]) -> float:
    """Fraction of the ops' forward + backward FLOPs that tensor parallelism divides."""
    total = sum(o.fwd_flops + o.bwd_flops for o in ops)
    split = sum(o.fwd_flops + o.bwd_flops for o in ops if o.tp_style != "replicated")
    return split / total if total else 0.0


@dataclass
class ModelGraph:
    name: str
    batch: int              # sequences in the captured example batch
    seq_len: int
    dtype_bytes: int        # bytes per element of parameters and activations at capture
    hidden: int
    vocab: int | None
    layers: list[Layer]
    capture_s: float = 0.0  # wall time of the capture, seconds
    method: str = ""        # how it was captured
    notes: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)  # the model's hyperparameters where known
    adapter: str = ""       # the runtime adapter that runs it: zoo | hf | module
    limits: dict[str, str] = field(default_factory=dict)  # feature -> why the runtime cannot run it
                                                          # (planner.plan.FEATURES)
    documents: DocumentMix | None = None  # packed documents per row (a planning input; module docstring)
    max_seq_len: int = 0    # tokens its learned position table covers (0: none; planner/frontend/positions.py)

    # ---- derived figures -------------------------------------------------
    @property
    def params(self) -> int:
        return sum(l.params for l in self.layers)

    @property
    def fwd_flops(self) -> float:
        return sum(l.fwd_flops for l in self.layers)

    @property
    def bwd_flops(self) -> float:
        return sum(l.bwd_flops for l in self.layers)

    def flops_per_seq(self) -> float:
        """Forward + backward FLOPs of one sequence."""
        return (self.fwd_flops + self.bwd_flops) / self.batch

    def act_bytes_per_seq(self) -> float:
        return sum(l.act_bytes for l in self.layers) / self.batch

    def layer(self, name: str) -> Layer:
        for l in self.layers:
            if l.name == name:
                return l
        raise KeyError(f"no layer {name!r} in graph {self.name!r}")

    def stage_groups(self) -> list[tuple[int, int]]:
        """Half-open layer ranges a pipeline stage boundary may not split: a layer whose
        ``stage_start`` is False joins the group before it."""
        groups: list[list[int]] = []
        for i, l in enumerate(self.layers):
            if groups and not l.stage_start:
                groups[-1][1] = i + 1
            else:
                groups.append([i, i + 1])
        return [(a, b) for a, b in groups]

    def classes(self) -> dict[str, list[int]]:
        """Signature -> indices of the layers that share it (repeated blocks are one class)."""
        out: dict[str, list[int]] = {}
        for i, l in enumerate(self.layers):
            out.setdefault(l.signature, []).append(i)
        return out

    def fingerprint(self) -> str:
        """Hash of structure and shapes (layer names, kinds, signatures, sizes): not of weights,
        nor of the planning inputs (``documents``, ``MoEDims.imbalance``): a plan names the model
        it runs, and ``autopar run`` / ``codegen`` check it against the model captured again
        from its spec, which carries neither."""
        key = [(l.name, l.kind, l.signature, l.params, round(l.fwd_flops), round(l.act_bytes))
               for l in self.layers]
        key.append((self.batch, self.seq_len, self.dtype_bytes, self.hidden, self.vocab))
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]

    # ---- JSON ---------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["schema"] = GRAPH_SCHEMA_VERSION
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ModelGraph":
        if d.get("schema") != GRAPH_SCHEMA_VERSION:
            raise ValueError(f"model graph schema {d.get('schema')!r} is not {GRAPH_SCHEMA_VERSION}: "
                             "capture the model again with this version of autopar")
        d = dict(d)
        d.pop("schema")
        layers = []
        for ld in d.pop("layers"):
            ld = dict(ld)
            ld["ops"] = [Op(**o) for o in ld.get("ops", [])]
            ld["linears"] = [Linear(**x) for x in ld.get("linears", [])]
            ld["matmuls"] = [Matmul(**x) for x in ld.get("matmuls", [])]
            if ld.get("attention") is not None:
                ld["attention"] = AttentionDims(**ld["attention"])
            if ld.get("moe") is not None:
                ld["moe"] = MoEDims(**ld["moe"])
            layers.append(Layer(**ld))
        if d.get("documents") is not None:
            docs = dict(d["documents"])
            d["documents"] = DocumentMix(**dict(docs, pieces=tuple(docs.get("pieces", ())),
                                                lengths=tuple(docs.get("lengths", ()))))
        return ModelGraph(layers=layers, **d)
