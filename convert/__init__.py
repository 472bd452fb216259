"""Hugging Face directory -> GGUF, llama.cpp-compatible (`kvcli convert`)."""

from convert.hf_to_gguf import convert_hf

__all__ = ["convert_hf"]
