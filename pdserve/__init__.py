"""pdserve: LLM serving with prefill and decode disaggregated over ZeroMQ.

``LLM`` and ``SamplingParams`` are imported lazily so that light modules
(the wire protocol, the CLI's help) do not pay for loading the engine.
"""
__all__ = ["LLM", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name):
    if name == "SamplingParams":
        from pdserve.common.sampling import SamplingParams
        return SamplingParams
    if name in ("LLM", "RequestOutput"):
        from pdserve import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
