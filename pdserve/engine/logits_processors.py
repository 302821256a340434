"""Changes a batch's logits before sampling, in vLLM's order and with its meanings:

1. structured output: tokens the request's grammar does not allow get -inf (stop tokens
   only where the grammar accepts the output so far);
2. min_tokens: the request's stop tokens (EOS unless ignore_eos, stop_token_ids) get -inf
   while it has fewer outputs;
3. logit_bias is added;
4. penalties: repetition_penalty divides positive logits (multiplies negative ones) of
   every token in the prompt or the output; frequency_penalty subtracts penalty x count
   and presence_penalty subtracts penalty once, for tokens of the output.

Logprobs are taken from the raw logits, before this stage. A request's tokens so far are
all the node needs: after a failover the output of earlier attempts is the end of the
prompt it was sent (``params.seed_offset`` tokens), and the grammar state is rebuilt by
replaying it. A batch where no request uses any of this costs one check per row.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pdserve.engine.grammar import GrammarBackend, GuideState, allowed_mask
from pdserve.engine.sequence import Sequence


class LogitsProcessors:
    def __init__(self, model_path: Path, vocab_size: int, eos_token_ids: tuple[int, ...]):
        self.model_path = model_path
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self._grammar: GrammarBackend | None = None
        # Requests whose grammar failed while decoding (llguidance's lexer budget, say),
        # with why: the engine ends them after the step, the rest of the batch goes on.
        self.failed: dict[str, str] = {}

    @property
    def grammar(self) -> GrammarBackend:
        if self._grammar is None:
            self._grammar = GrammarBackend(self.model_path, self.vocab_size, self.eos_token_ids)
        return self._grammar

    def check(self, params) -> None:
        """ValueError saying why the request's processing cannot run here (a token id
        outside the vocabulary, a guide that does not compile)."""
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias has token ids outside [0, {self.vocab_size}): "
                             f"{bad[:5]}")
        if params.guide is not None:
            self.grammar.matcher(params.guide)

    def guide_compiling(self, params):
        """A Future of the request's guide compiling on a worker thread; None when there is
        nothing to wait for (no guide, or compiled already)."""
        if params.guide is None or self.grammar.compiled(params.guide):
            return None
        return self.grammar.compile_soon(params.guide)

    def stop_ids(self, seq: Sequence) -> list[int]:
        p = seq.params
        return [*p.stop_token_ids, *(() if p.ignore_eos else self.eos_token_ids)]

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [S, V] float32 of ``seqs`` (one row each) -> the processed logits."""
        rows = [i for i, s in enumerate(seqs) if s.params.processes_logits]
        if not rows:
            return logits
        logits = logits.clone()
        guided = [i for i in rows if seqs[i].params.guide is not None]
        if guided:
            self._apply_guides(logits, [seqs[i] for i in guided], guided)
        early = [i for i in rows
                 if seqs[i].num_output_tokens < seqs[i].params.min_tokens]
        for i in early:
            row = logits[i].clone()
            logits[i, self.stop_ids(seqs[i])] = float("-inf")
            if seqs[i].params.guide is not None and not bool((logits[i] > float("-inf")).any()):
                logits[i] = row  # the grammar is complete: its end wins over min_tokens
        biased = [i for i in rows if seqs[i].params.logit_bias]
        if biased:
            r = [i for i in biased for _ in seqs[i].params.logit_bias]
            t = [tok for i in biased for tok in seqs[i].params.logit_bias]
            b = [v for i in biased for v in seqs[i].params.logit_bias.values()]
            logits.index_put_((torch.tensor(r, device=logits.device),
                               torch.tensor(t, device=logits.device)),
                              torch.tensor(b, dtype=logits.dtype, device=logits.device),
                              accumulate=True)
        penalised = [i for i in rows if _has_penalty(seqs[i].params)]
        if len(penalised) == len(seqs):
            logits = self._penalties(logits, seqs)
        elif penalised:
            logits[penalised] = self._penalties(logits[penalised],
                                                [seqs[i] for i in penalised])
        return logits

    def _apply_guides(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int]):
        states, kept, kept_seqs = [], [], []
        for seq, row in zip(seqs, rows):
            try:
                if seq.guide_state is None:
                    seq.guide_state = GuideState(self.grammar.matcher(seq.params.guide))
                seq.guide_state.catch_up(_output_ids(seq))
                if seq.guide_state.matcher.is_error():  # (a mask it cannot compute)
                    raise RuntimeError(f"structured output: "
                                       f"{seq.guide_state.matcher.get_error()}")
            except (RuntimeError, ValueError) as exc:  # this request fails, not the batch
                self.failed[seq.seq_id] = _first_line(str(exc))
                continue
            states.append(seq.guide_state)
            kept.append(row)
            kept_seqs.append(seq)
        if not kept:
            return
        allowed = allowed_mask(states, [self.stop_ids(s) for s in kept_seqs],
                               self.vocab_size, logits.device)            # [R, V]
        failed = [i for i, st in enumerate(states) if st.matcher.is_error()]
        for i in failed:  # the mask itself failed (a lexer budget hit while computing it)
            self.failed[kept_seqs[i].seq_id] = _first_line(
                f"structured output: {states[i].matcher.get_error()}")
        logits[kept] = logits[kept].masked_fill(~allowed, float("-inf"))

    def _penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logits [R, V] of the rows with a penalty -> penalised, all rows at once. Only the
        logits of tokens in each row's prompt or output change, so the work follows their
        number: gathered, penalised, scattered back (a repeated token writes one value)."""
        device, vocab = logits.device, self.vocab_size
        # Pads repeat the row's first token: they gather and write back its own value.
        ids = _padded([s.token_ids for s in seqs], None).to(device)       # [R, L]
        out_ids = _padded([_output_ids(s) for s in seqs], vocab).to(device)  # [R, O], pad V
        counts = torch.zeros((len(seqs), vocab + 1), device=device)       # [R, V + 1]
        counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
        rep = torch.tensor([s.params.repetition_penalty for s in seqs], device=device)[:, None]
        freq = torch.tensor([s.params.frequency_penalty for s in seqs], device=device)[:, None]
        pres = torch.tensor([s.params.presence_penalty for s in seqs], device=device)[:, None]
        picked, n = logits.gather(1, ids), counts.gather(1, ids)          # [R, L]
        picked = torch.where(picked > 0, picked / rep, picked * rep) - freq * n \
            - pres * (n > 0)
        return logits.scatter_(1, ids, picked)


def _has_penalty(params) -> bool:
    return bool(params.repetition_penalty != 1 or params.frequency_penalty
                or params.presence_penalty)


def _output_ids(seq: Sequence) -> list[int]:
    """Every output token of the request, those of earlier attempts included."""
    return seq.token_ids[seq.num_prompt_tokens - seq.params.seed_offset:]


def _padded(token_lists: list[list[int]], pad: int | None) -> torch.Tensor:
    """[R, max length] int64 of the lists, padded with ``pad`` (None: the list's first)."""
    width = max(1, max((len(t) for t in token_lists), default=0))
    return torch.tensor([t + [t[0] if pad is None else pad] * (width - len(t)) if t
                         else [0 if pad is None else pad] * width for t in token_lists],
                        dtype=torch.long)


def _first_line(why: str) -> str:
    """llguidance's errors end in a dump of its state: the first line says what failed."""
    return why.split("\n", 1)[0][:1000]
