"""How to pick each next token and when to stop: the one sampling type, checked where the
user hands it in and carried on the wire as it is (``PrefillRequest.sampling``,
``ReserveRequest.sampling``), as vLLM's SamplingParams is a msgspec Struct inside its
engine requests.

Each field's limits are its type's msgspec ``Meta``: a decoder checks them in C, and
``__post_init__`` runs the same check for a value built in Python (``msgspec.convert``
against a twin struct of the same fields), then the cross-field rules. So a new parameter
takes one field, any rule its type cannot say, and the code that uses it. The queue's
``Submit`` and the HTTP edge take their fields' types and limits from here.

Below the protocol (common/protocol imports it, never the other way round), so the
engine uses it without importing any wire module. No torch.
"""
import re
import reprlib
from typing import Annotated, Literal, Optional, get_type_hints

import msgspec
from msgspec import Meta

from pdserve.common.guides import GUIDE_KINDS
from pdserve.common.limits import MAX_INT, MAX_ITEMS, MAX_LOGPROBS, Seed, allowed

TokenId = Annotated[int, Meta(ge=0, lt=MAX_INT)]
SmallCount = Annotated[int, Meta(ge=0, lt=MAX_INT)]
NumAlternatives = Optional[Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]]
Penalty = Annotated[float, Meta(ge=-2, le=2)]
MAX_LOGIT_BIAS = 100.0   # biases are clamped to [-100, 100], as vLLM and OpenAI do


class SamplingParams(msgspec.Struct, array_like=True, gc=False):
    """temperature 0 means greedy. top_k 0 (or -1) and top_p 1 disable those filters.
    ``stop`` strings end the text just before the string; ``stop_token_ids`` and the
    model's EOS (unless ``ignore_eos``) end it after the token.

    On the wire the fields are an array in this order (docs/protocol.md): a new field goes
    at the end, with a default. ``stop`` is the router's (it has the text): it sends nodes
    the params with stop cleared (``for_nodes``)."""
    max_tokens: Annotated[int, Meta(ge=1, lt=MAX_INT)] = 16
    temperature: Annotated[float, Meta(ge=0, le=100)] = 1.0
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, lt=MAX_INT, description="0 or -1 disables it")] = 0
    seed: Optional[Seed] = None
    stop: Annotated[list[Annotated[str, Meta(min_length=1)]], Meta(max_length=MAX_ITEMS)] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_ITEMS)] = []
    ignore_eos: bool = False
    # Set by the router on failover, not by users: tokens already sampled in earlier
    # attempts, so a seeded request's random stream resumes where it stopped (and the
    # output of those attempts is the last seed_offset tokens of the prompt sent).
    seed_offset: SmallCount = 0
    # Logprobs (vLLM's meaning; None: not computed): each sampled token's, with `logprobs`
    # most likely alternatives; each prompt token's (the first has none), with
    # `prompt_logprobs` alternatives. Of the raw distribution, before any sampling setting.
    logprobs: NumAlternatives = None
    prompt_logprobs: NumAlternatives = None
    # Logits processing (engine/logits_processors.py), with vLLM's meanings: no stop token
    # before min_tokens outputs; repetition_penalty over prompt + output tokens, presence /
    # frequency over output tokens; logit_bias {token id: bias} (clamped to [-100, 100]);
    # guide: (kind, spec) of structured output (common/guides.py, engine/grammar.py).
    min_tokens: SmallCount = 0
    repetition_penalty: Annotated[float, Meta(gt=0, le=100, description="1 disables it")] = 1.0
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    logit_bias: Annotated[dict[TokenId, float], Meta(max_length=MAX_ITEMS)] = {}
    guide: Optional[tuple[Literal[GUIDE_KINDS], str]] = None

    def __post_init__(self):
        """Runs on construction, on msgspec.structs.replace and on decode: each field's own
        limits (what a decoder checks already), then the normal form (what a decoder builds:
        floats, lists, a tuple; top_k -1 as 0; biases clamped). The rules across fields are
        validate()'s, run where a request is taken in (the router's checks, the engine's
        check_request on every node and in the offline LLM): a message that breaks one of
        them then fails that request only, not every request decoded with it."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name, empty in (("stop", list), ("stop_token_ids", list), ("logit_bias", dict)):
            if getattr(self, name) is None:
                setattr(self, name, empty())
        self._check_fields()
        self._normalise()

    def validate(self) -> None:
        """The field limits, then the rules across fields; ValueError naming the field:
        "name=value is invalid: what is allowed". Again after a field was set by hand."""
        self._check_fields()
        if self.min_tokens > self.max_tokens:
            self._refuse("min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.guide is not None and self.ignore_eos:
            self._refuse("ignore_eos", "cannot be true with structured output: the output ends "
                         "when the grammar is complete")

    def _check_fields(self) -> None:
        try:
            msgspec.convert(self, _Checked, from_attributes=True)
        except msgspec.ValidationError as exc:
            found = _PATH.search(str(exc))
            if found is None or found.group(1) not in ALLOWED:
                raise ValueError(f"sampling parameters are invalid: {exc}") from None
            self._refuse(found.group(1), f"must be {ALLOWED[found.group(1)]}")
        if any(b != b for b in self.logit_bias.values()):  # NaN: no bound of a float says it
            self._refuse("logit_bias", f"must be {ALLOWED['logit_bias']}")

    def _normalise(self) -> None:
        for name in _FLOATS:
            value = getattr(self, name)
            if type(value) is not float:
                setattr(self, name, float(value))
        if self.top_k == -1:
            self.top_k = 0
        if type(self.stop) is not list:
            self.stop = list(self.stop)
        if type(self.stop_token_ids) is not list:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias:
            self.logit_bias = {t: max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b)))
                               for t, b in self.logit_bias.items()}
        if self.guide is not None and type(self.guide) is not tuple:
            self.guide = tuple(self.guide)

    def _refuse(self, name: str, rule: str):
        raise ValueError(f"{name}={reprlib.repr(getattr(self, name))} is invalid: {rule}")

    def for_nodes(self) -> "SamplingParams":
        """These params as nodes get them: stop strings stay with the router, which owns
        the text (nodes neither detokenize nor match them), and so stay out of every
        PrefillBatch and Reserve header."""
        return msgspec.structs.replace(self, stop=[]) if self.stop else self

    @property
    def processes_logits(self) -> bool:
        """Whether the logits processing stage has anything to do for this request."""
        return bool(self.min_tokens or self.repetition_penalty != 1 or self.presence_penalty
                    or self.frequency_penalty or self.logit_bias or self.guide)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


FIELDS = SamplingParams.__struct_fields__
FIELD_TYPES = get_type_hints(SamplingParams, include_extras=True)  # name -> type with limits
ALLOWED = allowed(SamplingParams)   # name -> what it accepts, in words
# The same fields and limits without __post_init__: what __post_init__ converts into.
_Checked = msgspec.defstruct("_Checked", [(f, FIELD_TYPES[f]) for f in FIELDS], gc=False)
_FLOATS = tuple(f for f in FIELDS if FIELD_TYPES[f] is float
                or getattr(FIELD_TYPES[f], "__origin__", None) is float)
_PATH = re.compile(r"`\$\.(\w+)")
