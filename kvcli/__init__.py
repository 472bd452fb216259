"""kvcli: run Llama-family GGUF models with a small KV cache."""

from kvcli.errors import KvcliError

__all__ = ["KvcliError", "Llama", "Sampler"]


def __getattr__(name):
    # Lazy: `import kvcli` (and `kvcli --help`) must not import torch.
    if name == "Llama":
        from kvcli.llama import Llama

        return Llama
    if name == "Sampler":
        from kvcli.sampler import Sampler

        return Sampler
    raise AttributeError(name)
