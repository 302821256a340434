"""The offline API, shaped the way vLLM users know it::

    from pdserve import LLM, SamplingParams
    llm = LLM()                       # the bundled default model
    out = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
    print(out[0].text)
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

from pdserve.common.sampling import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.types import Logprobs

log = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    # engine.types.Logprobs, with SamplingParams(logprobs=k) / (prompt_logprobs=k): of each
    # output token, and of prompt tokens 1.. (the first has none)
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None


class LLM:
    def __init__(self, model: str | None = None, dtype: str = "auto", device: str = "cpu",
                 **engine_args):
        self.engine = Engine(EngineConfig(model=None if model is None else str(model),
                                             dtype=dtype, device=device, **engine_args))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: Engine) -> "LLM":
        llm = cls.__new__(cls)
        llm.engine, llm.tokenizer, llm._ids = engine, engine.tokenizer, itertools.count()
        return llm

    def generate(self, prompts: Prompt | list[Prompt],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Runs every prompt to completion in one continuous batch; outputs in prompt order."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, list):
            raise TypeError(f"prompts must be a string, a list of token ids, or a list of "
                            f"those; got {type(prompts).__name__}")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        encoded = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if isinstance(prompt, str):
                ids = self.tokenizer.encode(prompt) if prompt else []
            elif isinstance(prompt, list):
                ids = list(prompt)
            else:
                raise TypeError(f"prompt {i} must be a string or a list of token ids, "
                                f"got {type(prompt).__name__}")
            self.engine.check_request(ids, p, what=f"prompt {i}")
            encoded.append(ids)
        # Everything is checked before anything is queued: one bad prompt queues nothing.
        results = {}
        for prompt, ids, p in zip(prompts, encoded, params):
            req_id = str(next(self._ids))
            self.engine.add_request(req_id, ids, p)
            results[req_id] = RequestOutput(req_id, prompt if isinstance(prompt, str) else None,
                                            ids, [], "", None)
        while self.engine.has_unfinished():
            for out in self.engine.step():
                r = results.get(out.req_id)
                if r is None:
                    continue
                r.token_ids.extend(out.new_token_ids)
                if out.logprobs is not None:
                    r.logprobs = r.logprobs or Logprobs()
                    r.logprobs.extend(out.logprobs)
                r.prompt_logprobs = out.prompt_logprobs or r.prompt_logprobs
                r.text += out.new_text
                r.finish_reason = out.finish_reason
            for req_id, (_, why) in self.engine.take_rejected().items():  # it cannot go on
                log.warning("request %s ended: %s", req_id, why)
                results[req_id].finish_reason = "error"
        return list(results.values())
