"""Rewrite a grouped-query (GQA) llama GGUF as the mathematically identical multi-head (MHA) one.

Query head i attends with KV head i // G (G = n_heads / n_kv_heads, as kvcli's attention and
transformers' `repeat_kv` group them), so repeating each KV head's rows of attn_k / attn_v G
times in place and setting head_count_kv = head_count gives the same outputs. Rows are whole
ggml blocks (blocks run along ne0 = n_embd), so quantized tensors are repeated byte for byte
and keep their type; every other tensor and all metadata (tokenizer included) are copied.
The K rows' per-head RoPE permutation (llama.cpp's converter) moves with its head.

    python3 -m kvcli.convert.mha models/SmolLM2-135M-Instruct.Q4_1.gguf models/SmolLM2-135M-MHA.Q4_1.gguf
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from kvcli.errors import KvcliError


def gqa_to_mha(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Write the MHA form of the GQA GGUF `src` to `dst` (atomically: a temporary file, then rename)."""
    import gguf

    reader = gguf.GGUFReader(os.fspath(src), "r")
    arch = reader.fields["general.architecture"].contents()
    n_head = int(reader.fields[f"{arch}.attention.head_count"].contents())
    kv_key = f"{arch}.attention.head_count_kv"
    n_kv = int(reader.fields[kv_key].contents()) if kv_key in reader.fields else n_head
    if n_head % n_kv:
        raise KvcliError(f"head_count {n_head} is not a multiple of head_count_kv {n_kv}")
    groups = n_head // n_kv

    dst = Path(dst)
    fd, tmp = tempfile.mkstemp(prefix=dst.name + ".", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch)
        for field in reader.fields.values():
            # GGUF.* are the reader's virtual fields; the writer adds the architecture itself.
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            value = n_head if field.name == kv_key else field.contents()
            writer.add_key_value(field.name, value, vtype, sub_type=sub)
            if field.name == "general.alignment":
                writer.data_alignment = int(value)
        if kv_key not in reader.fields:
            writer.add_head_count_kv(n_head)
        datas = []
        for t in reader.tensors:
            data = np.asarray(t.data)  # (rows, cols) or, quantized, (rows, row_bytes) uint8
            if groups > 1 and (t.name.endswith(".attn_k.weight") or t.name.endswith(".attn_v.weight")):
                rows = data.shape[0]
                # (Hkv, D, cols) -> (Hkv * G, D, cols): head j of the result is head j // G of the source
                data = np.repeat(data.reshape(n_kv, rows // n_kv, -1), groups, axis=0).reshape(rows * groups, -1)
            writer.add_tensor_info(t.name, data.shape, data.dtype, data.nbytes, t.tensor_type)
            datas.append(data)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for data in datas:
            writer.write_tensor_data(data, tensor_endianess=reader.endianess)
        writer.close()
        os.replace(tmp, dst)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dst


if __name__ == "__main__":  # pragma: no cover
    if len(sys.argv) != 3:
        sys.exit("usage: python3 -m kvcli.convert.mha SRC.gguf DST.gguf")
    print(gqa_to_mha(sys.argv[1], sys.argv[2]))
