"""The engine's frozen configuration, checked where a user sets it. Each field that is a
command-line flag says so once, here (common/config_fields.py)."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config import MODEL_DTYPES, QUANTIZATION_MODES
from pdserve.common.config_fields import check_fields, flag
from pdserve.sim.profile import check_sim_fields

DTYPES = (*MODEL_DTYPES, "auto")   # auto: model/loader.py auto_dtype
COMPUTE_MODES = ("model", "none", "simulated")
CPU_LINEAR_MODES = ("auto", "onednn", "torch")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = flag(None, "Checkpoint folder or .gguf file.", kind="path",
                             default_text="the bundled model, SmolLM2-135M-Instruct; "
                                          "pdserve model info prints its path")
    dtype: str = flag("auto", "The weights' and the KV cache's dtype. auto: on the CPU, "
                      "bfloat16 where it has AVX512-BF16 or AMX-BF16, or where a GGUF "
                      "file's int4 projections stay int4 on the native kernels (AVX2 "
                      "too), and float32 elsewhere (the start-up log says which and why); "
                      "on an accelerator, the checkpoint's own.", choices=DTYPES,
                      envvar="PDSERVE_DTYPE")
    device: str = flag("cpu", "torch device.")
    block_size: int = flag(16, "Tokens per KV block (a power of two).", min=1)
    num_kv_blocks: int | None = flag(None, "KV cache size in blocks.", min=1,
                                     default_text="from --kv-cache-memory-gb")
    kv_cache_memory_gb: float = flag(0.5, "KV cache size.", min=0, min_open=True)
    max_num_seqs: int = flag(64, "Sequences in one step's batch.", min=1)
    max_num_batched_tokens: int = flag(2048, "Token budget of one step; longer prompts are "
                                       "prefilled in chunks.", min=1)
    max_model_len: int | None = None     # None: the model's own limit
    threads: int | None = flag(None, "torch CPU threads.", min=1,
                               default_text="torch's choice; launch: every core, shared")
    compute: str = flag("model", "'none' is a BENCHMARK mode: skip the forward and emit a "
                        "fixed token, to measure everything around the model. 'simulated' "
                        "sleeps the step time --sim-profile predicts for a GPU and emits a "
                        "seeded token stream; all messaging stays real (docs/simulation.md).",
                        choices=COMPUTE_MODES)
    # sim/: the simulated accelerator and model
    sim_profile: str | None = flag(None, "With --compute simulated: a shipped profile's name "
                                   "(h100-llama3-8b, h200-llama3-8b, a100-llama3-8b, "
                                   "h100-llama3-70b) or a profile file (.json, .yaml).",
                                   metavar="NAME|FILE", default_text="none")
    # (vocabulary size, EOS ids, context) of --model (model/config.py read_token_space):
    # pdserve launch reads it once for every simulated node (a GGUF file's metadata takes
    # seconds to parse); None: the node reads it.
    sim_token_space: tuple | None = None
    sim_kv_bytes_scale: float = flag(1.0, "With --compute simulated: the KV pages nodes hold "
                                     "and ship have head_dim x SCALE elements (rounded, at "
                                     "least 1), so that many nodes fit in memory; block "
                                     "counts, capacity and step times stay the profile's.",
                                     min=0, max=1, min_open=True)
    enable_prefix_caching: bool = flag(True, "Reuse the KV cache of full blocks that "
                                       "earlier prompts computed.")
    # engine/decode_window.py
    decode_window_memory_gb: float | None = flag(
        None, "CPU decode steps that run torch's SDPA (float32, or without the native "
        "kernels) keep the batch's context contiguous across steps in at most this much "
        "memory, instead of gathering it from the KV pages in every layer; 0: off.", min=0,
        default_text="half of the KV cache's positions (float32: half its size)")
    # model/cpu_linear.py
    cpu_linear: str = flag(
        "auto", "float32 and bfloat16 linear layers on the CPU: 'onednn' reorders each "
        "weight once for oneDNN (about 1.6x faster GEMMs at decode rows; float32 results "
        "differ from F.linear's in the last bits, bfloat16 ones do not), 'torch' keeps "
        "F.linear (transformers' bits), 'auto' takes onednn where torch has it.",
        choices=CPU_LINEAR_MODES)
    # model/quant.py
    quantization: str = flag(
        "auto", "How a GGUF file's quantized weights are held: 'auto' keeps Q4_0/Q4_1/Q4_K "
        "projections as stored (int4, about 0.6 bytes a weight) where the CPU kernel is "
        "fast, today with --dtype bfloat16 only, and dequantizes the rest, saying which and "
        "why at start-up; 'none' dequantizes everything into --dtype; 'int4' is auto that "
        "refuses to start without int4 weights; 'int8' is not implemented.",
        choices=QUANTIZATION_MODES)

    def __post_init__(self):
        check_fields(self)
        check_sim_fields(self.compute, self.sim_profile, self.sim_kv_bytes_scale)
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and (
                not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got "
                             f"{self.max_model_len!r}")
