"""The router's checks of a request against the model and its configured limits: a
RequestError(BAD_REQUEST) naming the field and what is allowed, never a 500."""
from __future__ import annotations

from pdserve.router import streams as S
from pdserve.router.config import RouterConfig
from pdserve.sim.profile import unsimulated


def bad(message: str, param: str) -> S.RequestError:
    return S.RequestError(S.BAD_REQUEST, message, param)


def check_request(req: S.GenerationRequest, vocab: int, max_model_len: int,
                  cfg: RouterConfig) -> None:
    ids, params = req.prompt_token_ids, req.params
    if not ids:
        raise bad("the prompt is empty: it needs at least one token", "prompt")
    if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in ids):
        raise bad(f"prompt token ids must be integers in [0, {vocab})", "prompt")
    if len(ids) >= max_model_len:
        raise bad(f"the prompt has {len(ids)} tokens but the model's context is "
                  f"{max_model_len} tokens, leaving no room for output", "prompt")
    try:
        params.validate()
    except ValueError as exc:
        raise bad(str(exc), str(exc).split("=", 1)[0]) from None
    if params.max_tokens > max_model_len:
        raise bad(f"max_tokens={params.max_tokens} is over the model's context of "
                  f"{max_model_len} tokens", "max_tokens")
    if params.top_k > vocab:
        raise bad(f"top_k={params.top_k} is over the vocabulary size {vocab} (0 or -1 "
                  "disables it)", "top_k")
    if any(t >= vocab for t in params.stop_token_ids):
        raise bad(f"stop_token_ids must be token ids in [0, {vocab})", "stop_token_ids")
    if any(t >= vocab for t in params.logit_bias):
        raise bad(f"logit_bias keys must be token ids in [0, {vocab})", "logit_bias")
    check_stop(params.stop, cfg)
    if cfg.sim_profile and (refused := unsimulated(params)) is not None:
        raise bad(refused[1], refused[0])


def check_stop(stop: list[str], cfg: RouterConfig) -> None:
    if len(stop) > cfg.max_stop_strings:
        raise bad(f"stop has {len(stop)} strings; at most {cfg.max_stop_strings} are "
                  "accepted", "stop")
    longest = max((len(s.encode()) for s in stop), default=0)
    if longest > cfg.max_stop_bytes:
        raise bad(f"a stop string has {longest} bytes (UTF-8); at most {cfg.max_stop_bytes} "
                  "are accepted", "stop")


def check_prompt_bytes(text: str, cfg: RouterConfig, param: str = "prompt") -> None:
    """Before tokenizing: a prompt's text may have at most ``max_prompt_bytes`` bytes."""
    # len(str) <= UTF-8 bytes <= 4 * len(str): encode only when it could matter.
    if len(text) > cfg.max_prompt_bytes or (4 * len(text) > cfg.max_prompt_bytes
                                            and len(text.encode()) > cfg.max_prompt_bytes):
        raise S.RequestError(S.BAD_REQUEST, f"the {param} text is over {cfg.max_prompt_bytes} "
                             "bytes (UTF-8), the most accepted", param)


class PromptBound:
    """What a prompt's text may be before it is tokenized: at most ``max_prompt_bytes``
    (its UTF-8), and short enough that it could fit the context. A text longer than the
    context times the longest token's characters has more tokens than the context holds,
    whatever it says; it is refused without tokenizing it (a 3 MB chat message was
    tokenized whole before the context check refused it, and the router kept 313 MB)."""

    def __init__(self, cfg: RouterConfig, max_model_len: int, longest_token_chars: int):
        self.cfg, self.max_model_len = cfg, max_model_len
        self.longest = max(1, longest_token_chars)
        self.max_chars = max_model_len * self.longest

    def check(self, text: str, param: str = "prompt") -> None:
        check_prompt_bytes(text, self.cfg, param)
        if len(text) > self.max_chars:
            raise bad(f"the {param} text has {len(text)} characters, so at least "
                      f"{len(text) // self.longest} tokens, over the model's context of "
                      f"{self.max_model_len} tokens", param)

    def check_messages(self, messages: list[dict]) -> None:
        """A chat's messages (checked in number by openai_schema.chat_messages): their
        text as one."""
        self.check("".join(m["content"] for m in messages), "messages")
