"""The engine's state: model, KV cache, allocator and scheduler, sized and checked.

``Engine`` (engine.py) is a Worker with requests and the one step; the offline
``LLM`` and every node role hold one Engine.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

from pdserve.common.config import WEIGHTS_INT4
from pdserve.common.sampling import SamplingParams
from pdserve.engine.block_allocator import BlockAllocator
from pdserve.engine.config import EngineConfig
from pdserve.engine.decode_window import window_default_bytes
from pdserve.engine.host_memory import into_huge_pages, trim_malloc, tune_malloc
from pdserve.engine.logits_processors import LogitsProcessors
from pdserve.engine.model_runner import ModelRunner, kv_bytes_per_block
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.types import EngineStats, KVCacheLayout, ModelId
from pdserve.model.config import read_token_space
from pdserve.model.loader import (
    load_model,
    model_identity_hash,
    model_name,
    served_dtype,
)
from pdserve.model.quant import Int4Linear
from pdserve.sim.profile import load_profile, sim_identity, unsimulated

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, kv_storage=None):
        """``kv_storage``: see ModelRunner (where the CPU KV cache lives)."""
        self.config = config
        tune_malloc()  # before the model's and the first step's allocations
        if config.threads is not None:
            torch.set_num_threads(config.threads)
        model_dir = config.model
        if model_dir is None:
            from pdserve.model.default_model import default_model_dir
            model_dir = default_model_dir()
        self.model_dir = Path(model_dir)
        self.profile = None     # with compute "simulated": the sim profile (no model loaded)
        if config.compute == "simulated":
            self._simulated(config, kv_storage)
        else:
            self._load(config, kv_storage)
        self.runner.logits_processors = LogitsProcessors(
            self.model_dir, self.model_config.vocab_size, self.model_config.eos_token_ids)
        self.allocator = BlockAllocator(self.num_blocks, config.enable_prefix_caching,
                                        reserve=self.runner.kv_reserve)
        self.scheduler = Scheduler(self.allocator, config.block_size, config.max_num_seqs,
                                   config.max_num_batched_tokens)

    def _load(self, config: EngineConfig, kv_storage) -> None:
        self.model = load_model(self.model_dir, config.dtype, config.device,
                                config.quantization)
        self.model_config = self.model.config
        self.dtype, why = served_dtype(config.dtype, self.model_config, config.device,
                                       self.model_dir, config.quantization)
        if why is not None:
            log.info("dtype auto: %s (%s)", str(self.dtype).removeprefix("torch."), why)
        limit = self.model_config.max_model_len
        self.max_model_len = min(config.max_model_len or limit, limit)
        per_block = kv_bytes_per_block(self.model_config, config.block_size, self.dtype)
        num_blocks = self.num_blocks = config.num_kv_blocks or max(
            1, int(config.kv_cache_memory_gb * 2**30) // per_block)
        window_gb = config.decode_window_memory_gb
        self.runner = ModelRunner(self.model, num_blocks, config.block_size,
                                  config.device, self.dtype, config.compute, kv_storage,
                                  window_default_bytes(num_blocks * per_block, self.dtype)
                                  if window_gb is None else int(window_gb * 2**30),
                                  config.cpu_linear)
        if self.runner.device.type == "cpu":
            log.info("packed weights: %s",
                     self.model.place_streamed_weights(into_huge_pages))
        log.info("decode attention: %s; prefill attention: %s",
                 self.runner.describe_decode_attention(),
                 self.runner.describe_prefill_attention())

    def _simulated(self, config: EngineConfig, kv_storage) -> None:
        """No weights: the checkpoint's config gives the token space, the profile the KV
        shape, the capacity and the step times (engine/sim_runner.py)."""
        from pdserve.engine import sim_runner as sim  # (its imports only when simulating)

        self.profile = load_profile(config.sim_profile)
        self.model = None
        space = config.sim_token_space or read_token_space(self.model_dir)
        self.model_config = sim.sim_model_config(space, self.profile,
                                                 config.sim_kv_bytes_scale)
        self.dtype = sim.sim_dtype(self.profile)
        limit = self.model_config.max_model_len
        self.max_model_len = min(config.max_model_len or limit, limit)
        self.num_blocks = config.num_kv_blocks or sim.sim_num_blocks(self.profile,
                                                                     config.block_size)
        self.runner = sim.SimRunner(self.profile, self.model_config, self.num_blocks,
                                    config.block_size, self.dtype, kv_storage)

    def release_load_memory(self) -> None:
        """Gives back what loading left behind, once everything that reads the checkpoint
        has (the owner's tokenizer included): a GGUF file's parsed reader, cached for the
        readings of one load (the bundled model's holds 140-220 MiB; every weight kept was
        copied out of the file's mapping), and the load-time buffers freed into the heap."""
        if self.model_dir.is_file():
            from pdserve.model import gguf
            gguf.release_readers()
        trim_malloc()

    def longest(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The most tokens of KV cache a request can take: its prompt and every token it
        may generate, within the context."""
        return min(num_prompt_tokens + params.max_tokens, self.max_model_len)

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def identity(self) -> ModelId:
        if self.profile is not None:
            name, config_hash = sim_identity(self.profile, self.config.sim_kv_bytes_scale)
            return ModelId(name=name, config_hash=config_hash)
        # Weights held int4 (model/quant.py) compute other outputs than the same file
        # dequantized: the suffix keeps the two apart in a cluster (router/dispatch/registry.py)
        int4 = any(isinstance(m, Int4Linear) for m in self.model.modules())
        return ModelId(name=model_name(self.model_dir),
                       config_hash=model_identity_hash(self.model_dir) + WEIGHTS_INT4 * int4)

    def kv_layout(self) -> KVCacheLayout:
        cfg = self.model_config
        return KVCacheLayout(num_layers=cfg.num_hidden_layers,
                             num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                             dtype=str(self.dtype).removeprefix("torch."),
                             block_size=self.block_size)

    def stats(self, queued_prompt_tokens: int = 0) -> EngineStats:
        return EngineStats(num_free_blocks=self.allocator.num_free_blocks,
                           num_total_blocks=self.allocator.num_blocks,
                           num_running=self.scheduler.num_running,
                           num_waiting=self.scheduler.num_waiting,
                           queued_prompt_tokens=queued_prompt_tokens)

    def guide_compiling(self, params: SamplingParams):
        """A Future of the request's structured-output guide compiling off the caller's
        thread, or None when check_request need not wait for one (LogitsProcessors)."""
        return self.runner.logits_processors.guide_compiling(params)

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      what: str = "prompt") -> None:
        """Raises ValueError with the reason when a request cannot be served."""
        if not prompt_token_ids:
            raise ValueError(f"{what} is empty: it must have at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids
               if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} has token ids outside [0, {vocab}): {bad[:5]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"{what} has {len(prompt_token_ids)} tokens but the model's context "
                             f"is {self.max_model_len} tokens, leaving no room for output")
        params.validate()
        if self.profile is not None and (refused := unsimulated(params)) is not None:
            raise ValueError(refused[1])
        self.runner.logits_processors.check(params)
        longest = self.longest(len(prompt_token_ids), params)
        if self.scheduler.blocks_for(longest) > self.allocator.num_blocks:
            raise ValueError(f"{what} needs up to {longest} tokens of KV cache but the cache "
                             f"holds {self.allocator.num_blocks * self.block_size}")
