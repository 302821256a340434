"""The one error of loading a model, below every module of model/ (config.py and gguf.py
both raise it; config.py re-exports it)."""


class ModelLoadError(ValueError):
    """A checkpoint that cannot be served, with the reason a person can act on."""
