"""ProfileDB: measured collective and layer times of one cluster (a JSON file).

Written by ``cost_models/profiler.py`` (``autopar profile``), read by ``comm.py`` and
``compute.py``. Units: bytes and seconds.

JSON layout (``version`` 1)::

    {"version": 1, "cluster_fingerprint": "<Cluster.fingerprint()>",
     "backend": "nccl", "world": 16, "dtype": "bf16",
     "collectives": {"all_reduce/8/intra": [{"nbytes": 1024, "seconds": 1.2e-5}, ...]},
     "layers": {"<layer signature>": [{"shape": {"batch": 1, "seq_len": 2048, "tp": 2, "cp": 1},
                                        "fwd_s": 0.004, "bwd_s": 0.008}, ...]},
     "runtime": {"replicate_unit_s": 2.6e-4, ...},
     "calibration": {"compute_scale": 1.1, "overlap": 0.2, "comm_scale": 1.3, ...}}

``dtype`` is the compute dtype the layers were timed in (the profiler's ``--dtype``, by default
the cluster's plans' own: ``planner.precision.default_dtype``); a file without it was timed in
fp32. Layer times price only plans of that dtype (:meth:`ProfileDB.layer_time`): a bf16 plan
priced from fp32 timings was 7x too slow on an H200 (llama-1b, 3.16 s predicted, 0.44 s run).

Layer times are of the kernels the profiler runs (``PROFILED_KERNELS``): SDPA attention (the
runtime's ``attention=eager``), the model's own loss (``loss=eager``), linears in the compute dtype,
no ``torch.compile``. A plan with another attention or loss kernel on a GPU is priced from them by
the kernel model's ratio of the two (``cost_models.compute.KERNEL_SCALED``).

``runtime`` (optional, CPU clusters) holds the CPU runtime's own per-call work the profiler
measured (cost_models/cpu_runtime.py lists the keys: data-parallel wrappers, EP dispatch, DTensor
dispatch, the split backward).

``calibration`` (optional; absent = ``{}``) holds the cost-model coefficients fitted to
measured training runs by ``autopar calibrate`` (cost_models/calibrate.py lists the
keys and where each is read).

Collective keys are ``<kind>/<group_size>/<link>`` with kind in ``COLLECTIVE_KINDS``
and link in ``intra`` | ``inter`` | ``mixed`` (see ``comm.group_layout``). One more kind,
``FSDP_UNIT`` (CPU clusters), is not a single collective: what one FSDP2 unit of ``nbytes`` of
fp32 parameters adds to a forward and backward over an unwrapped one (its two all-gathers and
its gradient reduce-scatter as FSDP2 issues them, with their fresh buffers and copies, and its
hooks), ``nbytes`` its parameters' bytes (``cost_models.profile_runtime``).
``nbytes`` follows comm.py's convention: the per-rank buffer, i.e. the full tensor
for all_reduce, the gathered OUTPUT for all_gather, the full INPUT for
reduce_scatter, the per-rank buffer for all_to_all, the message for send_recv
(one-way time).

Interpolation of collectives, samples sorted by size ``s_1 < ... < s_k`` with
times ``t_i`` (duplicate sizes: their median):

- ``n <= s_1``: ``t_1`` (latency-bound, constant);
- ``s_i <= n <= s_{i+1}``: piecewise linear in log-log:
  ``log t = log t_i + (log n - log s_i) / (log s_{i+1} - log s_i) * (log t_{i+1} - log t_i)``
  (hits every measured point exactly);
- ``n > s_k``: ``t_k + (n - s_k) * (t_k - t_{k-1}) / (s_k - s_{k-1})``, linear in bytes
  at the last two points' incremental bandwidth; when that slope is not positive
  (noise), or only one sample exists, ``t_k * n / s_k`` (pure bandwidth).

Layer times: samples of one signature with the same tp and cp (exact match only).
An exact (batch, seq_len) match is returned as measured. Otherwise, if samples at
the same ``seq_len`` exist only those are used (attention cost is not linear in
seq_len), else all; times are interpolated linearly in tokens = batch * seq_len
between the two neighbouring token counts and scaled proportionally to tokens
(``t * tokens / tokens_edge``) outside the measured range.
"""
from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from planner.precision import DTYPES

PROFILE_VERSION = 1
# The plan options the profiler's layer times were measured with (module docstring).
PROFILED_KERNELS = {"attention": "eager", "loss": "eager", "fp8": "none", "compile": False}
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
FSDP_UNIT = "fsdp_unit"  # one FSDP2 unit's whole per-micro-batch traffic (module docstring)
LINKS = ("intra", "inter", "mixed")


def calibration(profile: "ProfileDB | None") -> dict[str, float]:
    """The fitted coefficients of a ProfileDB (``{}`` without a profile or a calibration)."""
    return getattr(profile, "calibration", None) or {}


def collective_key(kind: str, group_size: int, link: str) -> str:
    """The ``collectives`` key for a kind, process-group size and link class."""
    return f"{kind}/{int(group_size)}/{link}"


@dataclass
class CollectiveSample:
    """One measurement: ``nbytes`` (per-rank buffer, see module docstring) took ``seconds``."""

    nbytes: int
    seconds: float


@dataclass
class LayerSample:
    """One layer measurement at a shape: forward and backward seconds per step."""

    batch: int
    seq_len: int
    tp: int
    cp: int
    fwd_s: float
    bwd_s: float

    @property
    def shape(self) -> dict[str, int]:
        """The shape key dict as stored in JSON."""
        return {"batch": self.batch, "seq_len": self.seq_len, "tp": self.tp, "cp": self.cp}

    @property
    def tokens(self) -> int:
        """batch * seq_len."""
        return self.batch * self.seq_len


@dataclass
class ProfileDB:
    """Measured times for one cluster; see the module docstring for the layout."""

    cluster_fingerprint: str
    backend: str
    world: int
    collectives: dict[str, list[CollectiveSample]] = field(default_factory=dict)
    layers: dict[str, list[LayerSample]] = field(default_factory=dict)
    version: int = PROFILE_VERSION
    calibration: dict[str, float] = field(default_factory=dict)  # fitted by `autopar calibrate`
    runtime: dict[str, float] = field(default_factory=dict)  # measured CPU runtime work (cpu_runtime.KEYS)
    calibration_source: str = ""  # one line: what the calibration was fitted on (shown in plans)
    dtype: str = "fp32"  # the compute dtype the layers were timed in (module docstring)

    # ---- building ----------------------------------------------------------------
    def add_collective(self, kind: str, group_size: int, link: str, nbytes: int, seconds: float) -> None:
        """Record one collective measurement."""
        if kind not in COLLECTIVE_KINDS + (FSDP_UNIT,):
            raise ValueError(f"unknown collective kind {kind!r}: use one of {', '.join(COLLECTIVE_KINDS)}, {FSDP_UNIT}")
        if link not in LINKS:
            raise ValueError(f"unknown link {link!r}: use one of {', '.join(LINKS)}")
        self.collectives.setdefault(collective_key(kind, group_size, link), []).append(
            CollectiveSample(int(nbytes), float(seconds)))

    def add_layer(self, signature: str, batch: int, seq_len: int, tp: int, cp: int,
                  fwd_s: float, bwd_s: float) -> None:
        """Record one layer measurement."""
        self.layers.setdefault(signature, []).append(
            LayerSample(int(batch), int(seq_len), int(tp), int(cp), float(fwd_s), float(bwd_s)))

    def matches(self, cluster_fingerprint: str) -> bool:
        """True when this profile was measured on the cluster with that fingerprint."""
        return self.cluster_fingerprint == cluster_fingerprint

    # ---- (de)serialisation ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The JSON layout of the module docstring."""
        d = {
            "version": self.version,
            "cluster_fingerprint": self.cluster_fingerprint,
            "backend": self.backend,
            "world": self.world,
            "dtype": self.dtype,
            "collectives": {k: [{"nbytes": s.nbytes, "seconds": s.seconds} for s in v]
                            for k, v in sorted(self.collectives.items())},
            "layers": {k: [{"shape": s.shape, "fwd_s": s.fwd_s, "bwd_s": s.bwd_s} for s in v]
                       for k, v in sorted(self.layers.items())},
        }
        if self.calibration:
            d["calibration"] = {str(k): float(v) for k, v in sorted(self.calibration.items())}
        if self.runtime:
            d["runtime"] = {str(k): float(v) for k, v in sorted(self.runtime.items())}
        if self.calibration_source:
            d["calibration_source"] = self.calibration_source
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "profile") -> "ProfileDB":
        """Inverse of :meth:`to_dict`; raises a one-line ValueError on a bad layout."""
        if not isinstance(data, dict):
            raise ValueError(f"{source}: not a profile (expected a JSON object): run `autopar profile` again")
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(f"profile version {version}, expected {PROFILE_VERSION}: run `autopar profile` again")
        try:
            collectives = {
                str(k): [CollectiveSample(int(s["nbytes"]), float(s["seconds"])) for s in v]
                for k, v in data.get("collectives", {}).items()
            }
            layers = {
                str(k): [LayerSample(int(s["shape"]["batch"]), int(s["shape"]["seq_len"]),
                                     int(s["shape"].get("tp", 1)), int(s["shape"].get("cp", 1)),
                                     float(s["fwd_s"]), float(s["bwd_s"])) for s in v]
                for k, v in data.get("layers", {}).items()
            }
            calibration = {str(k): float(v) for k, v in (data.get("calibration") or {}).items()}
            if not all(math.isfinite(v) for v in calibration.values()):
                raise ValueError("calibration holds a non-finite coefficient")
            runtime = {str(k): float(v) for k, v in (data.get("runtime") or {}).items()}
            if not all(math.isfinite(v) and v >= 0 for v in runtime.values()):
                raise ValueError("runtime holds a negative or non-finite figure")
            dtype = str(data.get("dtype") or "fp32")
            if dtype not in DTYPES:
                raise ValueError(f"dtype {dtype!r} is none of {', '.join(DTYPES)}")
            return cls(cluster_fingerprint=str(data["cluster_fingerprint"]), backend=str(data["backend"]),
                       world=int(data["world"]), collectives=collectives, layers=layers, version=version,
                       calibration=calibration, runtime=runtime,
                       calibration_source=str(data.get("calibration_source") or ""),
                       dtype=dtype)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{source}: malformed profile ({type(e).__name__}: {e}): run `autopar profile` again") from None

    def to_json(self, path: str | os.PathLike[str]) -> None:
        """Write atomically (a temporary file in the same folder, then os.replace)."""
        from planner.files import write_atomic

        write_atomic(str(path), json.dumps(self.to_dict(), indent=1) + "\n", force=True)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "ProfileDB":
        """Read a profile JSON file; one-line ValueError when missing, unreadable or of another version."""
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ValueError(f"profile {p} not found: run `autopar profile` or fix the path") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"profile {p} unreadable ({e}): run `autopar profile` again") from None
        return cls.from_dict(data, source=str(p))

    # ---- queries -----------------------------------------------------------------------
    def collective_time(self, kind: str, group_size: int, link: str, nbytes: float) -> float | None:
        """Seconds for one collective, interpolated (module docstring); None if never measured."""
        samples = self.collectives.get(collective_key(kind, group_size, link))
        if not samples:
            return None
        return _interp_loglog(_merge_sizes(samples), float(nbytes))

    def measured(self, kind: str) -> bool:
        """Whether any group size of ``kind`` was measured."""
        return any(key.split("/", 1)[0] == kind for key in self.collectives)

    def collective_floor(self, kind: str, group_size: int, link: str) -> float | None:
        """Seconds of the smallest message measured for a collective (its per-call latency); None
        if never measured."""
        points = _merge_sizes(self.collectives.get(collective_key(kind, group_size, link)) or [])
        return points[0][1] if points else None

    def layer_time(self, signature: str, batch: int, seq_len: int, tp: int, cp: int,
                   dtype: str | None = None) -> tuple[float, float] | None:
        """(fwd_s, bwd_s) for a layer at a shape (module docstring); None if not measured at this
        tp/cp, or (``dtype`` given) timed in another compute dtype."""
        if dtype is not None and dtype != self.dtype:
            return None
        samples = [s for s in self.layers.get(signature, ()) if s.tp == tp and s.cp == cp]
        if not samples:
            return None
        exact = [s for s in samples if s.batch == batch and s.seq_len == seq_len]
        if exact:
            return (statistics.median(s.fwd_s for s in exact), statistics.median(s.bwd_s for s in exact))
        same_seq = [s for s in samples if s.seq_len == seq_len]
        pool = same_seq or samples
        by_tokens: dict[int, list[LayerSample]] = {}
        for s in pool:
            by_tokens.setdefault(s.tokens, []).append(s)
        xs = sorted(by_tokens)
        fw = [statistics.median(s.fwd_s for s in by_tokens[x]) for x in xs]
        bw = [statistics.median(s.bwd_s for s in by_tokens[x]) for x in xs]
        tokens = batch * seq_len
        return (_interp_linear(xs, fw, tokens), _interp_linear(xs, bw, tokens))


    def layer_fixed_share(self, signature: str, batch: int, seq_len: int, tp: int, cp: int,
                          k: int = 1) -> tuple[float, float]:
        """(forward, backward) share of a layer's time at ``batch`` sequences of ``seq_len`` that a
        call pays whatever its tokens (cost_models/seq_chunks.py: what each of ``k`` sequence
        chunks pays whole): ``t0 / t(batch seq_len)`` for the line ``t(n) = t0 + c n`` through the
        measured times at ``seq_len / k`` and ``seq_len`` (this batch, tp and cp), else through the
        two smallest token counts measured at ``seq_len``; ``t0`` clipped to ``[0, t(n1)]`` (a
        pass that does not grow with its tokens is all fixed). (0, 0) without two such points."""
        mine = [s for s in self.layers.get(signature, ()) if s.tp == tp and s.cp == cp]
        chunk = k > 1 and seq_len % k == 0 and any(s.batch == batch and s.seq_len == seq_len // k for s in mine)
        pts = [(batch, seq_len // k), (batch, seq_len)] if chunk else \
            [(n // seq_len, seq_len) for n in sorted({s.tokens for s in mine if s.seq_len == seq_len})][:2]
        if len(pts) < 2 or self.layer_time(signature, *pts[1], tp, cp) is None:
            return 0.0, 0.0
        n1, n2 = (bs * sl for bs, sl in pts)
        now = self.layer_time(signature, batch, seq_len, tp, cp)
        out = []
        for t1, t2, t in zip(*(self.layer_time(signature, bs, sl, tp, cp) for bs, sl in pts), now):
            t0 = min(max(t1 - (t2 - t1) / (n2 - n1) * n1, 0.0), t1)
            out.append(min(1.0, t0 / t) if t > 0 else 0.0)
        return out[0], out[1]


def _merge_sizes(samples: list[CollectiveSample]) -> list[tuple[float, float]]:
    by_size: dict[int, list[float]] = {}
    for s in samples:
        by_size.setdefault(s.nbytes, []).append(s.seconds)
    return [(float(n), statistics.median(ts)) for n, ts in sorted(by_size.items()) if n > 0]


def _interp_loglog(points: list[tuple[float, float]], n: float) -> float:
    """Piecewise log-log interpolation; constant below, linear-in-bytes above (module docstring)."""
    if not points:
        return 0.0
    s1, t1 = points[0]
    if n <= s1:
        return t1
    sk, tk = points[-1]
    if n >= sk:
        if n == sk:
            return tk
        if len(points) >= 2:
            sp, tp = points[-2]
            slope = (tk - tp) / (sk - sp)
            if slope > 0:
                return tk + (n - sk) * slope
        return tk * n / sk
    lo, hi = 0, len(points) - 1
    while hi - lo > 1:  # binary search: points[lo][0] <= n < points[hi][0]
        mid = (lo + hi) // 2
        if points[mid][0] <= n:
            lo = mid
        else:
            hi = mid
    sa, ta = points[lo]
    sb, tb = points[hi]
    if n == sa:
        return ta
    if ta <= 0 or tb <= 0:
        return ta + (tb - ta) * (n - sa) / (sb - sa)
    frac = (math.log(n) - math.log(sa)) / (math.log(sb) - math.log(sa))
    return math.exp(math.log(ta) + frac * (math.log(tb) - math.log(ta)))


def _interp_linear(xs: list[int], ys: list[float], x: float) -> float:
    """Linear between neighbours; proportional (y * x / x_edge) outside [xs[0], xs[-1]]."""
    if x <= xs[0]:
        return ys[0] * x / xs[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            xa, xb, ya, yb = xs[i - 1], xs[i], ys[i - 1], ys[i]
            return ya + (yb - ya) * (x - xa) / (xb - xa)
    return ys[-1]  # unreachable
