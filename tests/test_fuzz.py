"""Fuzzing every parser of user input: each input gives a valid object or a clean error.

A clean error is an ``AutoparError`` / ``ClusterError`` / ``PlanError`` (all ``ValueError``
subclasses) whose message is one line; anything else (KeyError, TypeError, a traceback)
is a bug. Parsers: cluster TOML files and ``parse_cluster`` strings, model spec strings
and model ``.toml`` files, ``--config`` strings, and plan files (mutated valid plans for
``Plan.from_dict``, truncated text for ``Plan.load``); plans that parse are also emitted,
so no field of a plan can crash codegen either. 1000 examples per parser.
"""
from __future__ import annotations

import copy
import json
import math
import os
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import cost_models.cluster as cluster_mod
import cost_models.machine as machine_mod
from codegen.emit import emit
from cost_models.cluster import Cluster, ClusterError, parse_cluster
from planner import zoo
from planner.errors import AutoparError
from planner.plan import ParallelConfig, Plan, PlanError

N = 1000
FUZZ = settings(max_examples=N, deadline=None, suppress_health_check=list(HealthCheck), database=None)
CLEAN = (AutoparError, ClusterError, PlanError)
_TMP = tempfile.mkdtemp(prefix="autopar-fuzz-")


def _clean(exc: BaseException) -> None:
    assert isinstance(exc, CLEAN), f"{type(exc).__name__}: {exc}"
    msg = str(exc)
    assert msg and "\n" not in msg and "\r" not in msg, repr(msg)


def _call(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except Exception as e:  # noqa: BLE001 - the point is which exceptions
        _clean(e)
        return None


def _write(name: str, data: str | bytes) -> str:
    path = os.path.join(_TMP, name)
    with open(path, "wb") as f:
        f.write(data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data)
    return path


# ------------------------------------------------------------------ TOML helpers

def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # an inline table (arrays of them: [[groups]], [[links]])
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    return json.dumps(str(v))


def _toml(d: dict, prefix: str = "") -> str:
    lines, tables = [], []
    for k, v in d.items():
        if isinstance(v, dict):
            tables.append((k, v))
        else:
            lines.append(f"{json.dumps(k)} = {_toml_value(v)}")
    for k, v in tables:
        name = f"{prefix}.{json.dumps(k)}" if prefix else json.dumps(k)
        lines.append(f"[{name}]")
        lines.append(_toml(v, name))
    return "\n".join(lines) + "\n"


SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**20), st.floats(allow_nan=True),
                    st.text(max_size=12))
TOML_SCALARS = st.one_of(st.booleans(), st.integers(-10**6, 10**20), st.floats(), st.text(max_size=12),
                         st.lists(st.integers(-5, 5), max_size=3))

VALID_CLUSTER = {
    "name": "fuzz", "nodes": 2, "devices_per_node": 8, "backend": "nccl",
    "device": {"name": "H100", "memory_gib": 80, "mem_bw_gbs": 3350, "peak_tflops": {"bf16": 989, "fp32": 67}},
    "intra": {"bandwidth_gbs": 450, "latency_us": 3}, "inter": {"bandwidth_gbs": 50, "latency_us": 10},
}


# two regions (one of another device type) and one link: structure errors (unknown group, missing
# link, negative bandwidth, ...) each give one line
VALID_GROUPED = dict(copy.deepcopy(VALID_CLUSTER), nodes=3, groups=[
    {"name": "east", "nodes": 2},
    {"name": "west", "nodes": 1, "device": {"name": "A100", "memory_gib": 80, "mem_bw_gbs": 2039,
                                            "peak_tflops": {"bf16": 312}}}],
    links=[{"from": "east", "to": "west", "bandwidth_gbs": 12.5, "latency_us": 10000}])


def _paths(d, prefix=()):
    out = [prefix] if prefix else []
    if isinstance(d, dict):
        for k, v in d.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(d, path, action, value):
    """Drop, replace, or retype the entry at ``path`` (a tuple of keys / indices)."""
    parent = d
    for k in path[:-1]:
        parent = parent[k]
    k = path[-1]
    if action == "drop":
        del parent[k]
    elif action == "replace":
        parent[k] = value
    elif action == "stringify":
        parent[k] = str(parent[k])
    elif action == "listify":
        parent[k] = [parent[k]]
    elif action == "negate" and isinstance(parent[k], (int, float)) and not isinstance(parent[k], bool):
        parent[k] = -parent[k]
    elif action == "zero" and isinstance(parent[k], (int, float)):
        parent[k] = 0


ACTIONS = st.sampled_from(["drop", "replace", "stringify", "listify", "negate", "zero"])
CLUSTER_PATHS = _paths(VALID_CLUSTER)


@st.composite
def cluster_toml(draw, valid=VALID_CLUSTER):
    kind = draw(st.sampled_from(["mutate", "mutate", "extra", "text", "truncate"]))
    if kind == "text":
        return draw(st.text(max_size=200))
    if kind == "truncate":
        full = _toml(valid)
        return full[: draw(st.integers(0, len(full)))]
    d = copy.deepcopy(valid)
    if kind == "extra":
        tables = [d, d["device"], d["device"]["peak_tflops"], d["intra"]]
        tables += [*d.get("groups", []), *d.get("links", [])]
        where = draw(st.sampled_from(tables))
        where[draw(st.text(min_size=1, max_size=8))] = draw(TOML_SCALARS)
    for _ in range(draw(st.integers(1, 3))):
        paths = _paths(d)
        if not paths:
            break
        _mutate(d, draw(st.sampled_from(paths)), draw(ACTIONS), draw(TOML_SCALARS))
    return _toml(d)


# ------------------------------------------------------------------ cluster

def test_valid_cluster_toml_parses():
    c = Cluster.from_toml(_write("valid.toml", _toml(VALID_CLUSTER)))
    assert c.world == 16 and c.device.peak_tflops["bf16"] == 989


@FUZZ
@given(cluster_toml())
def test_fuzz_cluster_toml(text):
    c = _call(Cluster.from_toml, _write("cluster.toml", text))
    if c is not None:
        assert isinstance(c, Cluster)
        c.validate()
        assert len(c.fingerprint()) == 16


def test_valid_grouped_cluster_toml_parses():
    c = Cluster.from_toml(_write("grouped.toml", _toml(VALID_GROUPED)))
    assert c.world == 24 and c.n_groups == 2 and c.mixed and c.group_device(1).name == "A100"
    assert c.topology.link(1, 0).bandwidth_gbs == 12.5  # one direction declared: symmetric


@FUZZ
@given(cluster_toml(VALID_GROUPED))
def test_fuzz_grouped_cluster_toml(text):
    c = _call(Cluster.from_toml, _write("grouped.toml", text))
    if c is not None:
        c.validate()
        assert sum(g.nodes for g in c.topology.groups) == c.nodes if c.topology else c.nodes >= 1
        assert Cluster.from_dict(c.to_dict()).fingerprint() == c.fingerprint()


@pytest.fixture
def fake_detect():
    """``local-cpu:N`` without measuring the CPU for every N (and without touching the real cache)."""
    real = cluster_mod.detect_cached
    fake = {}

    def detect(n):
        if n not in fake:
            saved = machine_mod.measure_cpu
            machine_mod.measure_cpu = lambda: (1e10, 1e10)
            try:
                fake[n] = Cluster.detect(n)
            finally:
                machine_mod.measure_cpu = saved
        return fake[n]

    cluster_mod.detect_cached = detect
    yield
    cluster_mod.detect_cached = real


CLUSTER_WORDS = st.sampled_from(cluster_mod.preset_names() + ["local-cpu", "local-cpu:", "dgx", ":", "", " ",
                                                               "x.toml", "/nonexistent/c.toml", _TMP])
COUNTS = st.one_of(st.integers(-3, 10**12).map(str), st.text(max_size=5), st.just("2 "), st.just("0x10"),
                   st.just("1_0"), st.just("٣"), st.just("+4"))


@st.composite
def cluster_spec(draw):
    kind = draw(st.sampled_from(["text", "word", "word:count"]))
    if kind == "text":
        return draw(st.text(max_size=40))
    w = draw(CLUSTER_WORDS)
    return w if kind == "word" else f"{w}:{draw(COUNTS)}"


@pytest.mark.slow
@FUZZ
@given(cluster_spec())
def test_fuzz_parse_cluster(fake_detect, spec):
    c = _call(parse_cluster, spec)
    if c is not None:
        assert isinstance(c, Cluster) and c.world >= 1


def test_parse_cluster_non_string():
    for bad in (None, 3, b"dgx-h100", ["dgx-h100"]):
        with pytest.raises(ClusterError):
            parse_cluster(bad)


# ------------------------------------------------------------------ model specs

MODEL_WORDS = st.sampled_from(list(zoo.PRESETS) + ["hf:", "hf:gpt-tiny", "hf:mllm-tiny", "hf:nope", "llama",
                                                   "x.toml", "a.b:c", "a..b:c", "os:nope", "json:loads",
                                                   "planner.zoo:PRESETS", ":", "a:", ":b", "a:b:c"])


@st.composite
def model_spec(draw):
    kind = draw(st.sampled_from(["text", "word", "mangled"]))
    if kind == "text":
        return draw(st.text(max_size=40))
    w = draw(MODEL_WORDS)
    if kind == "word":
        return w
    i = draw(st.integers(0, len(w)))
    return w[:i] + draw(st.text(max_size=3)) + w[i + draw(st.integers(0, 2)):]


@FUZZ
@given(model_spec())
def test_fuzz_model_spec(spec):
    ms = _call(zoo.load_model_spec, spec)
    if ms is not None:
        assert isinstance(ms, zoo.ModelSpec) and callable(ms.factory)


VALID_MODEL = {"arch": "llama", "layers": 2, "hidden": 64, "ffn_hidden": 128, "heads": 4, "kv_heads": 2,
               "vocab": 256, "seq_len": 32, "rope_theta": 10000.0, "norm_eps": 1e-5, "tie_embeddings": False}
MODEL_KEYS = st.sampled_from(list(VALID_MODEL) + ["name", "max_seq_len", "vision_layers", "vision_hidden",
                                                   "vision_heads", "vision_ffn_hidden", "image_size",
                                                   "patch_size", "channels", "bogus", "Layers"])
MODEL_VALUES = st.one_of(st.integers(-4, 300), st.sampled_from([float("nan"), float("inf"), -0.0, 1e-300]), st.sampled_from(["gpt", "llama", "mllm", "x", ""]), TOML_SCALARS)


@st.composite
def model_toml(draw):
    kind = draw(st.sampled_from(["mutate", "mutate", "nested", "text", "truncate"]))
    if kind == "text":
        return draw(st.text(max_size=200))
    if kind == "truncate":
        full = _toml(VALID_MODEL)
        return full[: draw(st.integers(0, len(full)))]
    d = dict(VALID_MODEL)
    for _ in range(draw(st.integers(1, 4))):
        key = draw(MODEL_KEYS)
        if draw(st.booleans()) and key in d:
            del d[key]
        else:
            d[key] = draw(MODEL_VALUES)
    return _toml({"model": d} if kind == "nested" else d)


@FUZZ
@given(model_toml())
def test_fuzz_model_toml(text):
    cfg = _call(zoo.load_config_toml, _write("model.toml", text))
    if cfg is not None:
        assert isinstance(cfg, zoo.ModelConfig)
        cfg.validate()
        assert math.isfinite(cfg.rope_theta) and math.isfinite(cfg.norm_eps) and cfg.num_params() > 0


# ------------------------------------------------------------------ --config

CONFIG_KEYS = st.sampled_from(["dp", "pp", "cp", "tp", "mbs", "schedule", "vpp", "zero", "recompute", "sp",
                               "dtype", "attention", "loss", "bogus", "DP", ""])
CONFIG_VALUES = st.one_of(st.integers(-2, 9).map(str), st.sampled_from(
    ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "fsdp", "ddp", "zero1", "selective", "full", "none", "on",
     "off", "bf16", "flash", "fused", "eager", "", "1.5", "x"]), st.text(max_size=6))


@st.composite
def config_str(draw):
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=60))
    items = [f"{draw(CONFIG_KEYS)}{draw(st.sampled_from(['=', ' = ', '==', ':', '']))}{draw(CONFIG_VALUES)}"
             for _ in range(draw(st.integers(0, 6)))]
    return draw(st.sampled_from([",", ", ", ",,", ";"])).join(items)


@FUZZ
@given(config_str())
def test_fuzz_parallel_config(s):
    cfg = _call(ParallelConfig.parse, s)
    if cfg is not None:
        assert cfg.world >= 1
        assert ParallelConfig.parse(cfg.to_str()) == cfg  # round trip


# ------------------------------------------------------------------ plan JSON

@pytest.fixture(scope="module")
def plan_dict():
    from cost_models.cluster import parse_cluster as pc
    from planner.frontend.load import load_graph
    from planner.search.planning import plan_model

    plan, _ = plan_model(load_graph("llama-tiny"), pc("local-cpu:2"), 4, spec="llama-tiny",
                         cluster_spec="local-cpu:2")
    return json.loads(plan.to_json())


JSON_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(),
                                     st.text(max_size=10)),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                           max_leaves=6)


def _load_and_emit(d):
    plan = _call(Plan.from_dict, d)
    if plan is not None:
        assert isinstance(plan, Plan)
        text = _call(emit, plan)
        if text is not None:
            compile(text, "train.py", "exec")  # whatever the plan says, the program is valid Python
        # a plan it accepted must round-trip exactly
        assert Plan.from_dict(json.loads(plan.to_json())).to_json() == plan.to_json()
    return plan


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_fuzz_plan_dict(plan_dict, data):
    d = copy.deepcopy(plan_dict)
    paths = _paths(d)
    for _ in range(data.draw(st.integers(1, 3))):
        paths = _paths(d)
        if not paths:
            break
        _mutate(d, data.draw(st.sampled_from(paths)), data.draw(ACTIONS), data.draw(JSON_VALUES))
    _load_and_emit(d)


def test_plan_dict_not_a_dict(plan_dict):
    for bad in (None, [], "plan", 3, [plan_dict]):
        with pytest.raises(PlanError):
            Plan.from_dict(bad)


@FUZZ
@given(data=st.data())
def test_fuzz_plan_file(plan_dict, data):
    text = json.dumps(plan_dict, indent=1, sort_keys=True)
    kind = data.draw(st.sampled_from(["truncate", "truncate", "splice", "bytes"]))
    if kind == "truncate":
        blob = text[: data.draw(st.integers(0, len(text)))]
    elif kind == "splice":
        i = data.draw(st.integers(0, len(text)))
        blob = text[:i] + data.draw(st.text(max_size=8)) + text[i + data.draw(st.integers(0, 8)):]
    else:
        blob = data.draw(st.binary(max_size=64))
    path = _write("plan.json", blob)
    plan = _call(Plan.load, path)
    if plan is not None:
        _call(emit, plan)


# ------------------------------------------------------------------ safety: plans are data

@pytest.mark.parametrize("where,value", [
    (("model", "name"), 'x"""\nimport os; os.system("id")\n"""'),
    (("cluster", "name"), "lab\n\"\"\"; import os"),
    (("model", "name"), "../../etc/cron.d/x"),
    (("model", "spec"), "os; import shutil"),
    (("model", "spec"), "__import__('os').system('id')"),
    (("pipeline", "stages", 0, "layers", 0), "embed'); import os; ('"),
    (("tensor_parallel", "layout"), {"layers.0'); import os; ('": "column"}),
    (("tensor_parallel", "layout"), {"layers.0.attn.q": "column\nimport os"}),
])
def test_code_in_a_plan_is_refused(plan_dict, where, value):
    d = copy.deepcopy(plan_dict)
    _mutate(d, where, "replace", value)
    with pytest.raises(PlanError):
        emit(Plan.from_dict(d))
    if where[0] == "pipeline":  # a layer name is checked when the plan is read, before any emit
        with pytest.raises(PlanError):
            Plan.from_dict(d)


def test_plan_files_are_json_only(plan_dict):
    import pickle

    path = _write("plan.pkl", pickle.dumps(plan_dict))
    with pytest.raises(PlanError, match="unreadable|not valid JSON"):
        Plan.load(path)


def test_codegen_does_not_import_a_plans_model_function(plan_dict, tmp_path):
    import sys

    from planner.entry.launch import check_plan

    d = copy.deepcopy(plan_dict)
    d["model"]["spec"] = "autopar_fuzz_never_imported:build"
    plan = Plan.from_dict(d)
    check_plan(plan, import_user_code=False)
    assert "import_module" not in emit(plan) and "autopar_fuzz_never_imported" not in sys.modules


def test_data_hook_is_a_dotted_name():
    from codegen.runtime.data import user_hook

    for bad in ("os.system('id'):x", "os:system; rm", "a.b", ":f", "__import__('os'):x"):
        with pytest.raises(ValueError):
            user_hook(bad, 4, 32)


def test_plan_for_another_model_or_machine_is_refused(plan_dict):
    from planner.entry.launch import check_plan

    check_plan(Plan.from_dict(plan_dict))                      # the real one passes
    for key, what in (("model", "model"), ("cluster", "cluster")):
        d = copy.deepcopy(plan_dict)
        d[key]["fingerprint"] = "0123456789abcdef"
        with pytest.raises(PlanError, match=f"plan is for {what}"):
            check_plan(Plan.from_dict(d))
