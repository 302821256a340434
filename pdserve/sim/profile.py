"""A simulation profile: an accelerator, a model over some tensor-parallel ranks, the
roofline's coefficients and an output-length (EOS) distribution, read from JSON or YAML.

``load_profile("h100-llama3-8b")`` reads a shipped profile (profiles/NAME.json);
``load_profile("my.json")`` a user's own. Every field is checked here, with a message
naming the field and what is allowed (docs/simulation.md describes each one).
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
EOS_KINDS = ("geometric", "fixed", "uniform", "never")


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: float           # dense FLOP/s of one device in the model's dtype
    memory_bandwidth: float     # bytes/s of one device
    memory_bytes: float         # of one device


@dataclass(frozen=True)
class SimModel:
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_model_len: int
    dtype: str = "bfloat16"
    tie_word_embeddings: bool = False


@dataclass(frozen=True)
class Roofline:
    compute_efficiency: float     # of peak FLOP/s a prefill reaches
    bandwidth_efficiency: float   # of the memory bandwidth a step's reads reach
    step_overhead_s: float        # fixed cost of each decode step (launches, sampling)
    memory_utilization: float = 0.9  # of the devices' memory weights + KV may take


@dataclass(frozen=True)
class EosDistribution:
    """How many tokens a request outputs, EOS included, unless max_tokens ends it first:
    geometric (mean ``mean_tokens``), fixed (``tokens``), uniform in [``min_tokens``,
    ``max_tokens``], or never (only max_tokens ends a request)."""
    kind: str = "geometric"
    mean_tokens: float = 256.0
    tokens: int = 256
    min_tokens: int = 1
    max_tokens: int = 512


@dataclass(frozen=True)
class Profile:
    name: str
    accelerator: Accelerator
    model: SimModel
    roofline: Roofline
    eos: EosDistribution
    tensor_parallel: int = 1
    seed: int = 0
    sources: tuple[str, ...] = ()

    def model_hash(self) -> str:
        """The simulated model's fingerprint: nodes with equal ones hold the same KV shape
        (accelerators may differ: a fleet can mix them)."""
        text = json.dumps(asdict(self.model), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def load_profile(name_or_path: str) -> Profile:
    """The shipped profile of that name, or the profile in that .json/.yaml file;
    ValueError saying what is wrong."""
    path = Path(name_or_path)
    if not path.is_file():
        shipped = PROFILE_DIR / f"{name_or_path}.json"
        if "/" in name_or_path or not shipped.is_file():
            raise ValueError(f"sim profile {name_or_path!r} is neither a file nor one of the "
                             f"shipped profiles ({', '.join(shipped_profiles())})")
        path = shipped
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as exc:
            raise ValueError(f"{path}: YAML profiles need PyYAML (pip install pyyaml); "
                             "or write the profile as JSON") from exc
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"{path}: not valid YAML: {exc}") from exc
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    return profile_from_dict(data, str(path))


def profile_from_dict(data, where: str = "profile") -> Profile:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a profile is a mapping, got {type(data).__name__}")
    known = {"name", "accelerator", "model", "roofline", "eos", "tensor_parallel", "seed",
             "sources"}
    _no_unknown(data, known, where)
    for key in ("accelerator", "model", "roofline"):
        if key not in data:
            raise ValueError(f"{where}: '{key}' is missing")
    sources = data.get("sources", [])
    if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
        raise ValueError(f"{where}: 'sources' must be a list of strings")
    profile = Profile(
        name=_get(data, "name", str, where, Path(where).stem),
        accelerator=_section(Accelerator, data["accelerator"], f"{where}: accelerator"),
        model=_section(SimModel, data["model"], f"{where}: model"),
        roofline=_section(Roofline, data["roofline"], f"{where}: roofline"),
        eos=_section(EosDistribution, data.get("eos", {}), f"{where}: eos"),
        tensor_parallel=_get(data, "tensor_parallel", int, where, 1),
        seed=_get(data, "seed", int, where, 0), sources=tuple(sources))
    _check(profile, where)
    return profile


def _no_unknown(data: dict, known, where: str) -> None:
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown}; allowed: {sorted(known)}")


def _get(data: dict, key: str, tp: type, where: str, default):
    value = data.get(key, default)
    ok = isinstance(value, tp) and not isinstance(value, bool) if tp is not bool \
        else isinstance(value, bool)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok or (tp is float and not math.isfinite(value)):
        raise ValueError(f"{where}: '{key}' must be {tp.__name__}, got {value!r}")
    return value


def _section(cls, data, where: str):
    if not isinstance(data, dict):
        raise ValueError(f"{where}: must be a mapping, got {type(data).__name__}")
    _no_unknown(data, [f.name for f in fields(cls)], where)
    values = {}
    for f in fields(cls):
        tp = {"str": str, "int": int, "float": float, "bool": bool}[f.type]
        if f.name not in data and f.default is f.default_factory:  # MISSING both: required
            raise ValueError(f"{where}: '{f.name}' is missing")
        values[f.name] = _get(data, f.name, tp, where, f.default)
    return cls(**values)


def _check(p: Profile, where: str) -> None:
    def positive(section: str, obj, *names):
        for n in names:
            if getattr(obj, n) <= 0:
                raise ValueError(f"{where}: {section}.{n} must be > 0, got {getattr(obj, n)}")
    positive("accelerator", p.accelerator, "peak_flops", "memory_bandwidth", "memory_bytes")
    positive("model", p.model, "num_layers", "num_heads", "num_kv_heads", "head_dim",
             "hidden_size", "intermediate_size", "vocab_size", "max_model_len")
    if p.model.num_heads % p.model.num_kv_heads:
        raise ValueError(f"{where}: model.num_heads must be a multiple of num_kv_heads")
    if p.model.dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: model.dtype must be one of {sorted(DTYPE_BYTES)}, "
                         f"got {p.model.dtype!r}")
    r = p.roofline
    for n in ("compute_efficiency", "bandwidth_efficiency", "memory_utilization"):
        if not 0 < getattr(r, n) <= 1:
            raise ValueError(f"{where}: roofline.{n} must be in (0, 1], got {getattr(r, n)}")
    if r.step_overhead_s < 0:
        raise ValueError(f"{where}: roofline.step_overhead_s must be >= 0")
    if p.tensor_parallel < 1:
        raise ValueError(f"{where}: tensor_parallel must be >= 1, got {p.tensor_parallel}")
    e = p.eos
    if e.kind not in EOS_KINDS:
        raise ValueError(f"{where}: eos.kind must be one of {EOS_KINDS}, got {e.kind!r}")
    if e.mean_tokens < 1 or e.tokens < 1 or not 1 <= e.min_tokens <= e.max_tokens:
        raise ValueError(f"{where}: eos needs mean_tokens >= 1, tokens >= 1 and "
                         "1 <= min_tokens <= max_tokens")


def scaled_head_dim(p: Profile, kv_scale: float) -> int:
    """The head_dim of the KV pages simulated nodes hold and ship: the model's times
    ``--sim-kv-bytes-scale``, rounded, at least 1 (so the smallest scale that changes
    anything is 1/head_dim)."""
    if not 0 < kv_scale <= 1:
        raise ValueError(f"sim_kv_bytes_scale must be in (0, 1], got {kv_scale!r}")
    return max(1, round(p.model.head_dim * kv_scale))


def sim_identity(p: Profile, kv_scale: float) -> tuple[str, str]:
    """(name, config hash) simulated nodes announce, and a router with the same profile
    and scale expects: the profile's model and the KV pages' size."""
    h = hashlib.sha256(f"{p.model_hash()}:{scaled_head_dim(p, kv_scale)}".encode())
    return f"sim-{p.model.name}", h.hexdigest()[:16]


def check_sim_fields(compute: str, sim_profile: str | None, kv_scale: float) -> None:
    """ValueError unless a profile comes with --compute simulated (and only with it), and
    it loads."""
    if compute == "simulated" and sim_profile is None:
        raise ValueError("compute 'simulated' needs sim_profile (--sim-profile NAME|FILE; "
                         f"shipped: {', '.join(shipped_profiles())})")
    if sim_profile is not None and compute != "simulated":
        raise ValueError(f"sim_profile is for compute 'simulated', not {compute!r}")
    if sim_profile is not None:
        scaled_head_dim(load_profile(sim_profile), kv_scale)


def unsimulated(params) -> tuple[str, str] | None:
    """(the field, why) when a request asks what a simulated node cannot give: its tokens
    are a stream, not a model's distribution. The router answers 400 with it; a node
    refuses the request with it."""
    if params.guide is not None:
        return "response_format", ("structured output cannot be honoured by --compute "
                                   "simulated nodes: their tokens are a seeded stream")
    if params.logprobs is not None or params.prompt_logprobs is not None:
        return "logprobs", ("--compute simulated nodes compute no logprobs: their tokens "
                            "are a seeded stream")
    return None
