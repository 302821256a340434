"""Owns everything on the device: the model, the KV cache, the forward and sampling.

Shared by prefill and decode nodes and by the offline ``LLM``.
"""
from __future__ import annotations

from typing import Callable

import torch

from pdserve.engine.inputs import ModelInputs, build_model_inputs
from pdserve.engine.sampler import make_generator, sample
from pdserve.engine.scheduler import ScheduledBatch
from pdserve.model.llama import LlamaForCausalLM


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int,
                 device: torch.device | str, dtype: torch.dtype, compute: str = "model"):
        cfg = model.config
        model.fuse_projections()
        self.model = model
        self.compute = compute
        # compute="none": the token every sampled sequence gets, never an EOS
        self.fixed_token = next(t for t in range(10, cfg.vocab_size)
                                if t not in cfg.eos_token_ids)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        self.dtype = dtype
        self.logits_processors = None  # engine/logits_processors.py, set by the Worker
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # One K and one V tensor per layer: [num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=self.device),
             torch.zeros(shape, dtype=dtype, device=self.device))
            for _ in range(cfg.num_hidden_layers)
        ]

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        chunks, starts, tables, mask = [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            chunks.append(seq.token_ids[start:start + n])
            starts.append(start)
            tables.append(seq.block_table)
            mask.append(batch.samples(i))
        return build_model_inputs(chunks, starts, tables, mask, self.block_size, self.device)

    @torch.inference_mode()
    def forward(self, inputs: ModelInputs,
                on_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """One forward; returns the float32 logits [S, vocab] of the sampled rows."""
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_caches,
                            on_layer)
        return self.model.compute_logits(hidden[inputs.logits_indices])

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch,
                on_layer: Callable[[int], None] | None = None) -> list[int | None]:
        """Runs the batch; returns the sampled token of each sequence (None for a
        prefill chunk that does not reach the end of its prompt yet)."""
        if self.compute == "none":
            if on_layer is not None:  # the KV (zeros) still ships, layer group by group
                for layer in range(len(self.kv_caches)):
                    on_layer(layer)
            return [self.fixed_token if batch.samples(i) else None for i in range(len(batch))]
        inputs = self.prepare(batch)
        logits = self.forward(inputs, on_layer)
        out: list[int | None] = [None] * len(batch)
        if inputs.sample_rows:
            seqs = [batch.seqs[i] for i in inputs.sample_rows]
            for seq in seqs:
                if seq.generator is None and seq.params.seed is not None:
                    seq.generator = make_generator(seq.params, self.device,
                                                   self.model.config.vocab_size,
                                                   seq.num_output_tokens)
            if self.logits_processors is not None:
                logits = self.logits_processors.apply(logits, seqs)
            tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
            for row, token in zip(inputs.sample_rows, tokens):
                out[row] = token
        return out
