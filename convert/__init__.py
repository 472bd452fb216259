"""Hugging Face directory -> GGUF, llama.cpp-compatible (`kvcli convert`)."""

from kvcli.convert.hf_to_gguf import convert_hf

__all__ = ["convert_hf"]
