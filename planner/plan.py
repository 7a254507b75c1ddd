"""The plan contract: a parallel configuration, a stage partition, and the Plan file.

Contract: imports only the other contracts (errors, low_comm, dp_shares, precision, recompute_rules,
sharding, the schedule IR),
so the cost models and codegen can read it. ``ParallelConfig`` is what the search enumerates and
``autopar evaluate --config`` parses; ``Partition`` is what the stage ILP produces.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from planner.dp_shares import parse_shares, shares_problem
from planner.errors import PlanError
from planner.low_comm import low_comm_problem
from planner.precision import DTYPES
from planner.recompute_rules import RECOMPUTE, recompute_problem
from planner.schedule_check import check
from planner.schedule_file import parse_json, to_json
from planner.schedule_ir import Schedule, layout_problem, seq_chunks_problem
from planner.sharding import ZERO
from planner.vocab_passes import layout_problem as vp_layout_problem, stage_layers

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")   # the searched built-in schedules (planner/schedule_ir.py)
# what a config may name: those, DualPipeV (vpp = 2, V-shaped) and custom (the plan's own schedule IR)
RUN_SCHEDULES = SCHEDULES + ("dualpipev", "custom")

FP8_RECIPES = ("none", "tensorwise", "rowwise")  # torchao float8 training recipes (codegen/runtime/fp8.py)
QUIET_DEFAULTS = {"threads": 0, "fp8": "none", "compile": False, "low_comm": "", "seq_chunks": 1,
                  "dp_shares": "", "vocab_passes": False}  # fields a plan records only when set
ATTN_KERNELS = ("flash", "eager")      # flash: no S x S scores kept (SDPA flash / our Triton kernel)
LOSS_KERNELS = ("fused", "eager")      # fused: linear + cross-entropy without [tokens x vocab] logits
MESH_DIMS = ("pp", "dp", "cp", "tp")   # outer to inner
ADAPTERS = ("zoo", "hf", "module")     # how the runtime reaches into the model (codegen/runtime/adapters)
TP_ROLES = ("column", "row", "packed_qkv", "vocab_embed", "embed", "vocab_head", "norm")  # tensor_parallel.py


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "on", "yes"):
        return True
    if s.lower() in ("0", "false", "off", "no"):
        return False
    raise PlanError(f"expected on/off, got {s!r}")


@dataclass(frozen=True)
class ParallelConfig:
    """One point of the search space. Degrees multiply to the world size; mesh order is
    ``[pp, dp, cp, tp]`` outer to inner. Expert parallelism (``ep``) is not a mesh dimension
    of its own: it splits the ranks holding distinct tokens of one pipeline stage (dp x cp
    x tp, flattened, tp inner: under TP the MoE layers run on each rank's sequence shard)
    into groups of ``ep`` consecutive ranks, each holding ``experts / ep`` of every MoE
    layer's routed experts; the ranks at the same place in the other groups (``dp * cp *
    tp / ep`` of them, the experts' data-parallel group) hold the same experts
    (``planner.feasibility.expert_groups``)."""
    dp: int = 1
    pp: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1                  # expert parallel degree (routed experts split over ep of the dp x cp x tp ranks)
    ulysses: int = 1             # CP's Ulysses degree (divides cp): 1 ring, cp Ulysses, between: the 2-D hybrid
    mbs: int = 1                 # micro-batch size, sequences per micro-batch per dp rank
    schedule: str = "1f1b"       # pipeline schedule (ignored when pp == 1)
    vpp: int = 1                 # virtual stages (chunks) per pp rank, interleaved schedule only
    zero: str = "ddp"            # DP sharding: ddp | zero1 | zero2 | fsdp
    recompute: str = "none"      # one of RECOMPUTE (uniform; a Partition may choose per stage)
    sp: bool = False             # sequence parallel with TP
    dtype: str = "bf16"          # compute dtype (mixed precision with fp32 master weights unless fp32)
    attention: str = "flash"
    loss: str = "eager"
    threads: int = 0             # intra-op threads per rank (CPU clusters); 0: cores / ranks (feasibility.rank_threads)
    fp8: str = "none"            # the blocks' linears in float8 (torchao): none | tensorwise | rowwise (FP8_RECIPES)
    compile: bool = False        # each block through torch.compile (regional compilation)
    low_comm: str = ""           # low-communication DP across groups of replicas, "GxH:dtype" (planner/low_comm.py)
    seq_chunks: int = 1          # each micro-batch's sequence cut into k pipeline units (Seq1F1B; schedule_ir.py)
    dp_shares: str = ""          # per dp rank, sequences of each micro-batch, "SxN+..." (planner/dp_shares.py); "": mbs each
    vocab_passes: bool = False   # the head split by vocabulary into one stage per pp rank (planner/vocab_passes.py)

    @property
    def world(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def rank_mbs(self) -> tuple[int, ...]:
        """Per dp rank: the sequences it takes of each micro-batch (``dp_shares``, else ``mbs`` each)."""
        return parse_shares(self.dp_shares) or (self.mbs,) * self.dp

    @property
    def seq_shards(self) -> int:
        """Pieces the tp group cuts each cp rank's sequence into outside the tensor-parallel
        ops: tp under sequence parallel, else 1 (every tp rank holds the whole shard)."""
        return self.tp if self.sp else 1

    @property
    def expert_mesh(self) -> tuple[int, int]:
        """``(edp, ep)``: one pipeline stage's dp x cp x tp ranks (flattened, tp inner: under TP
        the MoE layers run on each rank's sequence shard) as the experts' data-parallel group
        times the expert-parallel group, ep inner: ``ep`` consecutive ranks share a layer's
        experts out, the ``edp = dp * cp * tp / ep`` ranks at the same place in each group hold
        the same experts. The one statement of the groups: ``planner.feasibility.expert_groups``
        lists their ranks, ``cost_models.memory.dp_group`` sizes the experts' sharding, the
        runtime's ``codegen.runtime.expert_parallel.expert_mesh`` builds them. (With ep = 1 the
        routed experts are not split: they shard and reduce like the rest of the block.)"""
        return self.dp * self.cp * self.tp // self.ep, self.ep

    def validate(self) -> "ParallelConfig":
        for k in ("dp", "pp", "cp", "tp", "ep", "mbs", "vpp"):
            v = getattr(self, k)
            if not isinstance(v, int) or v < 1:
                raise PlanError(f"{k}={v!r}: must be a positive integer")
        if not isinstance(self.threads, int) or isinstance(self.threads, bool) or self.threads < 0:
            raise PlanError(f"threads={self.threads!r}: must be 0 (cores / ranks per node) or a positive integer")
        for k, allowed in (("schedule", RUN_SCHEDULES), ("zero", ZERO), ("recompute", RECOMPUTE),
                           ("dtype", DTYPES), ("attention", ATTN_KERNELS), ("loss", LOSS_KERNELS)):
            if getattr(self, k) not in allowed:
                raise PlanError(f"{k}={getattr(self, k)!r}: choose one of {', '.join(allowed)}")
        if self.fp8 not in FP8_RECIPES:
            raise PlanError(f"fp8={self.fp8!r}: choose one of {', '.join(FP8_RECIPES)}")
        if not isinstance(self.compile, bool):
            raise PlanError(f"compile={self.compile!r}: must be on or off")
        if self.fp8 != "none" and self.dtype == "fp32":
            raise PlanError(f"fp8={self.fp8} casts the bf16 compute copies: it needs dtype=bf16")
        if (why := low_comm_problem(self.low_comm, self.dp, self.ep) or
                seq_chunks_problem(self.seq_chunks, self.schedule, self.pp, self.vpp, self.cp) or
                shares_problem(self.dp_shares, self.dp, self.mbs, self.pp, self.ep, self.low_comm)) is not None:
            raise PlanError(why)
        if self.vpp > 1 and self.schedule not in ("interleaved-1f1b", "dualpipev", "custom"):
            raise PlanError(f"vpp={self.vpp} needs schedule=interleaved-1f1b (or dualpipev, or a custom schedule)")
        if self.schedule == "dualpipev" and self.vpp != 2:
            raise PlanError(f"schedule=dualpipev runs 2 stages per rank: set vpp=2, not {self.vpp}")
        if self.vocab_passes is not False and (why := vp_layout_problem(self)):
            raise PlanError(why)
        if self.sp and self.tp == 1:
            raise PlanError("sp=on needs tp > 1 (sequence parallel shards along the tp group)")
        if self.cp % self.ulysses:
            raise PlanError(f"ulysses={self.ulysses} must divide cp={self.cp} (Ulysses degree x ring degree = cp)")
        return self

    @property
    def cp_method(self) -> str:
        """How context parallel runs: ``ring`` (ring attention over cp),
        ``ulysses`` (all-to-all trading the sequence split for a head split around attention,
        over all cp ranks) or ``hybrid`` (Ulysses over groups of ``ulysses`` consecutive cp
        ranks, ring attention across the ``cp / ulysses`` groups: USP / LoongTrain's 2-D CP); ``none`` without CP."""
        if self.cp == 1:
            return "none"
        return "ring" if self.ulysses == 1 else ("ulysses" if self.ulysses == self.cp else "hybrid")

    def label(self) -> str:
        """Short human label, e.g. 'dp2 pp4 tp8 mbs1 1f1b fsdp sel sp'."""
        parts = [f"dp{self.dp}", f"pp{self.pp}", f"cp{self.cp}", f"tp{self.tp}"]
        parts[2:2] = [f"ulysses{self.ulysses}"] if self.ulysses > 1 else []
        parts += ([f"ep{self.ep}"] if self.ep > 1 else []) + [f"mbs{self.mbs}"]
        parts += [self.schedule + (f"(v{self.vpp})" if self.vpp > 1 else "")] if self.pp > 1 else []
        parts += [self.zero] + ([f"rc-{self.recompute}"] if self.recompute != "none" else [])
        parts += (["sp"] if self.sp else []) + ([f"threads{self.threads}"] if self.threads else [])
        parts += [f"fp8-{self.fp8}"] if self.fp8 != "none" else []
        parts += ["compiled"] if self.compile else []
        parts += ([f"low-comm-{self.low_comm}"] if self.low_comm else []) + (
            [f"seq-chunks{self.seq_chunks}"] if self.seq_chunks > 1 else [])
        parts += [f"shares{self.dp_shares}"] if self.dp_shares else []
        parts += ["vocab-passes"] if self.vocab_passes else []
        return " ".join(parts)

    def to_str(self) -> str:
        """``key=value`` for every field (``ulysses`` only when CP uses it, ``threads``, ``fp8`` and
        ``compile`` only when set: plans without them read and write as before)."""
        return ",".join(f"{f.name}={_fmt(getattr(self, f.name))}" for f in fields(self)
                        if (f.name != "ulysses" or self.ulysses > 1) and not self._quiet(f.name))

    def fields_dict(self) -> dict[str, Any]:
        """Every field by name, as the plan file's ``parallel`` section records them (the quiet
        ones, ``QUIET_DEFAULTS``, when set)."""
        return {k: v for k, v in asdict(self).items() if not self._quiet(k)}

    def _quiet(self, name: str) -> bool:
        return name in QUIET_DEFAULTS and getattr(self, name) == QUIET_DEFAULTS[name]

    @staticmethod
    def parse(s: str) -> "ParallelConfig":
        """Parse ``"dp=2,pp=4,tp=8,mbs=1,schedule=1f1b,zero=fsdp,recompute=selective,sp=on"``;
        omitted keys take their defaults."""
        if not isinstance(s, str) or not s.strip():
            raise PlanError("empty --config: give e.g. 'dp=2,pp=2,tp=2'")
        kw: dict[str, Any] = {}
        names = {f.name: f for f in fields(ParallelConfig)}
        for item in s.split(","):
            item = item.strip()
            if not item:
                continue
            m = re.fullmatch(r"([a-z_][a-z0-9_]*)\s*=\s*(\S+)", item)
            if not m:
                raise PlanError(f"bad --config item {item!r}: write key=value, e.g. tp=8")
            k, v = m.group(1), m.group(2)
            if k not in names:
                raise PlanError(f"unknown --config key {k!r}: use {', '.join(names)}")
            if k in kw:
                raise PlanError(f"--config key {k!r} given twice")
            typ = names[k].type
            try:
                if typ in ("int", int):
                    kw[k] = int(v)
                elif typ in ("bool", bool):
                    kw[k] = _bool(v)
                else:
                    kw[k] = v
            except ValueError:
                raise PlanError(f"--config {k}={v!r}: expected {typ}") from None
        return ParallelConfig(**kw).validate()

    def replace(self, **kw: Any) -> "ParallelConfig":
        return replace(self, **kw)


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


@dataclass
class Partition:
    """Stage split of the layers: ``bounds[j]`` is the half-open layer range ``[a, b)`` of
    virtual stage j (``pp * vpp`` entries; virtual stage j runs on pp rank ``j % pp``),
    and ``recompute[j]`` its recompute policy."""
    bounds: list[tuple[int, int]]
    recompute: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.bounds = [tuple(b) for b in self.bounds]  # type: ignore[misc]
        if not self.recompute:
            self.recompute = ["none"] * len(self.bounds)

    @staticmethod
    def even(n_layers: int, stages: int, recompute: str = "none") -> "Partition":
        """Equal layer counts (the first stages take the remainder)."""
        if stages > n_layers:
            raise PlanError(f"{stages} stages for {n_layers} layers: use at most {n_layers} stages")
        q, r = divmod(n_layers, stages)
        bounds, a = [], 0
        for j in range(stages):
            b = a + q + (1 if j < r else 0)
            bounds.append((a, b))
            a = b
        return Partition(bounds, [recompute] * stages)

    def validate(self, n_layers: int) -> "Partition":
        a = 0
        for j, (lo, hi) in enumerate(self.bounds):
            if lo != a or hi <= lo:
                raise PlanError(f"stage {j} range [{lo}, {hi}) is not contiguous and non-empty")
            a = hi
        if a != n_layers:
            raise PlanError(f"stages cover {a} of {n_layers} layers")
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------- model facts (rule: planner/feasibility.py)

FEATURES = ("any", "tp", "sp", "cp", "pp", "ep", "fused_loss", "flash_attention",   # keys of ModelFacts.limits
            "fsdp_with_tp", "attention")  # attention: autopar cannot run its attention in place of the model's


@dataclass(frozen=True)
class ModelFacts:
    """What the feasibility rule needs to know of a model, from its captured graph and its
    runtime adapter: attention head counts (one entry per attention layer kind), hidden
    size, ``units`` (the most pipeline stages it can be cut into), sequence length,
    ``limits``: feature (:data:`FEATURES`) -> one-line reason the runtime cannot run it, and
    ``max_seq_len``: the longest sequence its learned position table covers (0: no such table;
    planner/frontend/positions.py finds it)."""
    heads: tuple[int, ...] = ()
    kv_heads: tuple[int, ...] = ()
    hidden: int = 0
    units: int = 1
    seq_len: int = 0
    limits: dict[str, str] = field(default_factory=dict)
    experts: int = 0                # routed experts per MoE layer (0: no MoE layer)
    max_seq_len: int = 0            # tokens its learned positions cover (0: no learned positions)

    def to_dict(self) -> dict[str, Any]:
        d = {"heads": list(self.heads), "kv_heads": list(self.kv_heads), "hidden": self.hidden,
             "units": self.units, "seq_len": self.seq_len, "limits": dict(self.limits), "experts": self.experts}
        return {**d, "max_seq_len": self.max_seq_len} if self.max_seq_len else d  # unlimited: as before

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ModelFacts":
        limits = d.get("limits", {})
        if not isinstance(limits, dict) or any(k not in FEATURES or not isinstance(v, str) for k, v in limits.items()):
            raise PlanError(f"model.facts.limits must map {', '.join(FEATURES)} to reasons")
        return ModelFacts(tuple(int(x) for x in d.get("heads", ())), tuple(int(x) for x in d.get("kv_heads", ())),
                          int(d.get("hidden", 0)), int(d.get("units", 1)), int(d.get("seq_len", 0)), dict(limits),
                          int(d.get("experts", 0)), int(d.get("max_seq_len", 0)))


# ---------------------------------------------------------------------- the plan file

PLAN_VERSION = 1


@dataclass
class Plan:
    """What the planner chose, why, and everything codegen needs (and nothing else).

    Written as JSON with sorted keys and no timings, so the same inputs give a
    byte-identical file. ``stages[j]`` is virtual stage j: it runs on pp rank ``stages[j]["rank"]``
    (``j % pp`` but for dualpipev and custom schedules) as its chunk ``stages[j]["chunk"]``.
    """
    model: dict[str, Any]               # name, spec, fingerprint, layers (unit names in order), params
    cluster: dict[str, Any]             # name, spec, fingerprint, nodes, devices_per_node, backend, memory_gib
    config: ParallelConfig
    batch: dict[str, Any]               # global, micro, microbatches, seq_len (ints); with packed documents
                                        # ("--seq-lens") "documents": their summary (cost_models/documents.py)
    stages: list[dict[str, Any]]        # {"rank", "chunk", "layers": [names], "recompute"}
    tp_layout: dict[str, str]           # module fqn -> column | row | vocab_embed | embed | vocab_head | norm
    estimate: dict[str, Any]            # step_s, tokens_per_s, mfu, memory per stage, breakdown, source
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    rejected: dict[str, dict[str, Any]] = field(default_factory=dict)   # reason -> {"count", "examples"}
    search: dict[str, Any] = field(default_factory=dict)
    version: int = PLAN_VERSION
    schedule_ir: Schedule | None = None  # schedule=custom: the pipeline's own schedule (planner/schedule_ir.py)

    @property
    def mesh(self) -> dict[str, Any]:
        return {"dims": list(MESH_DIMS), "shape": list(self.config.mesh_shape)}

    @property
    def kernels(self) -> dict[str, str]:
        return {"attention": self.config.attention, "loss": self.config.loss}

    @property
    def facts(self) -> ModelFacts:
        """The model facts the feasibility rule needs (the runtime checks them again)."""
        return ModelFacts.from_dict(self.model.get("facts") or {})

    def partition(self) -> Partition:
        names = stage_layers(self.model["layers"], self.config.vocab_passes, self.config.pp)
        index = {n: i for i, n in enumerate(names)}
        bounds = [(index[s["layers"][0]], index[s["layers"][-1]] + 1) for s in self.stages]
        return Partition(bounds, [s["recompute"] for s in self.stages])

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version, "model": self.model, "cluster": self.cluster,
            "mesh": self.mesh, "config": self.config.to_str(), "parallel": self.config.fields_dict(),
            "batch": self.batch, "kernels": self.kernels,
            "pipeline": {"schedule": self.config.schedule if self.config.pp > 1 else "none",
                         "virtual_stages": self.config.vpp, "stages": self.stages,
                         **({"schedule_ir": json.loads(to_json(self.schedule_ir))} if self.schedule_ir else {})},
            "tensor_parallel": {"degree": self.config.tp, "sequence_parallel": self.config.sp,
                                "layout": self.tp_layout},
            "context_parallel": {"degree": self.config.cp, "method": self.config.cp_method,
                                 "ulysses": self.config.ulysses, "ring": self.config.cp // self.config.ulysses,
                                 "load_balance": "zigzag"},
            "data_parallel": {"degree": self.config.dp, "sharding": self.config.zero},
            "estimate": self.estimate, "alternatives": self.alternatives, "rejected": self.rejected,
            "search": self.search,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_dict(d: Any, source: str = "plan") -> "Plan":
        """The plan a JSON object describes, checked (:meth:`check`); one-line errors naming ``source``."""
        if not isinstance(d, dict):
            raise PlanError(f"{source}: not a plan (expected a JSON object); write it with `autopar plan`")
        v = d.get("version")
        if v != PLAN_VERSION:
            raise PlanError(f"{source}: plan schema version {v!r}, this autopar reads {PLAN_VERSION}; "
                            "plan again with `autopar plan`")
        try:
            cfg = ParallelConfig.parse(d["config"])
            plan = Plan(model=dict(d["model"]), cluster=dict(d["cluster"]), config=cfg, batch=dict(d["batch"]),
                        stages=list(d["pipeline"]["stages"]), tp_layout=dict(d["tensor_parallel"]["layout"]),
                        estimate=dict(d["estimate"]), alternatives=list(d.get("alternatives", [])),
                        rejected=dict(d.get("rejected", {})), search=dict(d.get("search", {})), version=v,
                        schedule_ir=(check(parse_json(json.dumps(d["pipeline"]["schedule_ir"]), where="the plan's "
                                     "pipeline.schedule_ir")) if "schedule_ir" in d["pipeline"] else None))
            plan.check()
            return plan
        except PlanError as e:
            raise PlanError(f"{source}: {e}; plan again with `autopar plan`") from None
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise PlanError(f"{source}: malformed plan ({type(e).__name__}: {e}); plan again with `autopar plan`") from None

    def check(self) -> None:
        """Refuse (PlanError) a plan whose parts are malformed or do not fit together; nothing from a
        plan file reaches a program unchecked (names are plain, layouts are module paths)."""
        self._check_model()
        self._check_stages()
        for fqn, role in self.tp_layout.items():
            if not re.fullmatch(r"[A-Za-z_][\w]*(\.[\w]+)*", fqn) or role not in TP_ROLES:
                raise PlanError(f"bad tensor-parallel entry {fqn!r}: {role!r}")
        for k in ("global", "micro", "microbatches", "seq_len"):
            if not _is_int(self.batch.get(k)) or self.batch[k] < 1:
                raise PlanError(f"batch.{k} must be a positive integer")
        if not isinstance(self.batch.get("documents", {}), dict):
            raise PlanError("batch.documents must be an object")
        for k in ("nodes", "devices_per_node"):
            if k in self.cluster and (not _is_int(self.cluster[k]) or self.cluster[k] < 1):
                raise PlanError(f"cluster.{k} must be a positive integer")
        for k in ("step_s", "tokens_per_s", "mfu"):
            if not _is_num(self.estimate.get(k)):
                raise PlanError(f"estimate.{k} must be a finite number")
        mem = self.estimate.get("memory_gib", [])
        if not isinstance(mem, list) or not all(_is_num(x) for x in mem):
            raise PlanError("estimate.memory_gib must be a list of numbers")

    def _check_model(self) -> None:
        names = self.model["layers"]
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise PlanError("model.layers must be a list of layer names")
        if self.model.get("adapter", "zoo") not in ADAPTERS:
            raise PlanError(f"model.adapter {self.model.get('adapter')!r} is not one of {', '.join(ADAPTERS)}")
        if not isinstance(self.model.get("facts", {}), dict):
            raise PlanError("model.facts must be an object")
        if self.model.get("vocab") is not None and (not _is_int(self.model["vocab"]) or self.model["vocab"] < 1):
            raise PlanError("model.vocab must be a positive integer")
        self.facts  # validates the limits
        for what, d in (("model", self.model), ("cluster", self.cluster)):
            # names reach file names and the emitted program's docstring: no quotes, slashes, newlines
            if not isinstance(d.get("name"), str) or not _NAME.fullmatch(d["name"]):
                raise PlanError(f"{what}.name {d.get('name')!r} is not a plain name")
            for k in ("spec", "fingerprint"):
                if not isinstance(d.get(k, ""), str):
                    raise PlanError(f"{what}.{k} must be a string")

    def _check_stages(self) -> None:
        cfg = self.config
        names = stage_layers(self.model["layers"], cfg.vocab_passes, cfg.pp)
        if len(self.stages) != cfg.pp * cfg.vpp:
            raise PlanError(f"{len(self.stages)} stages for pp*vpp = {cfg.pp * cfg.vpp}")
        if (self.schedule_ir is not None) != (cfg.pp > 1 and cfg.schedule == "custom"):
            raise PlanError("pipeline.schedule_ir goes with schedule=custom (pp > 1), and only with it")
        m, k = self.batch["microbatches"], cfg.seq_chunks
        if self.schedule_ir and (why := layout_problem(self.schedule_ir, cfg.pp, cfg.vpp, m, k)):
            raise PlanError(why)
        for s in self.stages:
            if not s.get("layers") or any(n not in names for n in s["layers"]):
                raise PlanError("a stage names a layer the model does not have")
            if s.get("recompute") not in RECOMPUTE:
                raise PlanError(f"stage recompute {s.get('recompute')!r} is not one of {', '.join(RECOMPUTE)}")
            if (p := recompute_problem(s["recompute"], cfg.schedule, cfg.pp)):
                raise PlanError(p)
        self.partition().validate(len(names))

    @staticmethod
    def load(path: str) -> "Plan":
        import json

        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except FileNotFoundError:
            raise PlanError(f"plan file {path} not found: check the path or run `autopar plan -o {path}`") from None
        except (OSError, UnicodeDecodeError) as e:
            raise PlanError(f"plan file {path} unreadable ({e}); give a JSON plan written by `autopar plan`") from None
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {path} is not valid JSON (truncated? {e.msg.removesuffix(' at')} at line {e.lineno}, column {e.colno}); "
                            "plan again with `autopar plan`") from None
        return Plan.from_dict(d, source=path)

    def save(self, path: str, force: bool = False) -> None:
        """Atomic write (temporary file + rename); refuses to overwrite without ``force``."""
        from planner.files import write_atomic
        write_atomic(path, self.to_json(), force=force)

    def check_fingerprints(self, model_fp: str | None = None, cluster_fp: str | None = None) -> None:
        if model_fp is not None and model_fp != self.model.get("fingerprint"):
            raise PlanError(f"plan is for model {self.model.get('name')!r} with fingerprint "
                            f"{self.model.get('fingerprint')}, not this model ({model_fp}): plan this model again")
        if cluster_fp is not None and cluster_fp != self.cluster.get("fingerprint"):
            raise PlanError(f"plan is for cluster {self.cluster.get('name')!r} ({self.cluster.get('fingerprint')}), "
                            f"not this one ({cluster_fp}): plan for this cluster again")


_NAME = re.compile(r"[\w][\w .:+()@-]{0,199}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")
