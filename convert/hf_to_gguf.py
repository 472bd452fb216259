"""Hugging Face Llama/Mistral/Qwen2/Qwen3 directory -> one GGUF file that kvcli and llama.cpp both load.

Follows llama.cpp's convert_hf_to_gguf.py (LlamaModel, Qwen2Model, Qwen3Model) for the layout: tensor
names, Q/K rows permuted to adjacent-pair RoPE for llama only (qwen2/qwen3 keep Hugging Face's rows: llama.cpp
rotates them NEOX-style), `{arch}.*` keys, norms and biases in F32, quantized types through gguf.quants.
Tensors are streamed: the header and tensor table are written from the checkpoint's shapes alone,
then each tensor is loaded, converted and written before the next one is read.

    convert_hf("models/SmolLM2-135M", "smol.gguf", outtype="q8_0")
"""

from __future__ import annotations

import math
import os
import re
import sys
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvcli.convert.vocab import add_vocab, read_json
from kvcli.errors import KvcliError
from kvcli.memory import MIB

# config.json's architecture -> the GGUF general.architecture written (llama.cpp's model_arch)
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
             "Qwen3ForCausalLM": "qwen3"}
ARCHITECTURES = tuple(GGUF_ARCH)
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
OUTTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rotate-half rows -> GGUF adjacent-pair rows, per head (llama.cpp's LlamaModel.permute).

    (n_head * head_dim, n_embd) viewed as (n_head, 2, head_dim/2, n_embd): row i of a head's first
    half and row i of its second half become rows 2i and 2i+1, the pair RoPE rotates together."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class HParams:
    """The config.json fields the decoder needs, checked."""
    arch: str  # config.json's architecture; gguf_arch: what the file says
    gguf_arch: str
    n_layers: int
    n_embd: int
    n_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int | None
    rms_eps: float
    rope_theta: float
    rope: dict  # rope_scaling / rope_parameters merged; "rope_type" normalised
    tied: bool
    explicit_head_dim: bool


def read_hparams(hf_dir: Path) -> HParams:
    cfg = read_json(hf_dir / "config.json", required=True)
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise KvcliError(f"config.json in {hf_dir} has no 'architectures' list")
    if archs[0] not in ARCHITECTURES:
        raise KvcliError(f"unsupported architecture {archs[0]!r} (convert supports {', '.join(ARCHITECTURES)})")
    if cfg.get("quantization_config"):
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        raise KvcliError(f"pre-quantized checkpoints ({method}) are not supported; convert the f16/bf16/f32 weights")

    def pos_int(key: str, default: Any = None) -> int:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise KvcliError(f"config.json: {key} must be a positive integer, got {value!r}")
        return value

    def number(key: str, default: float) -> float:
        value = cfg.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise KvcliError(f"config.json: {key} must be a number, got {value!r}")
        return float(value)

    n_embd, n_heads = pos_int("hidden_size"), pos_int("num_attention_heads")
    n_kv_heads = pos_int("num_key_value_heads", n_heads)
    if n_heads % n_kv_heads:
        raise KvcliError(f"config.json: num_attention_heads {n_heads} is not a multiple of "
                         f"num_key_value_heads {n_kv_heads}")
    explicit = cfg.get("head_dim") is not None
    head_dim = pos_int("head_dim") if explicit else n_embd // n_heads
    if not explicit and n_embd % n_heads:
        raise KvcliError(f"config.json: hidden_size {n_embd} is not a multiple of num_attention_heads {n_heads}")
    if head_dim % 2:
        raise KvcliError(f"config.json: head dimension {head_dim} is odd; RoPE needs pairs")
    ctx = pos_int("max_position_embeddings") if cfg.get("max_position_embeddings") is not None else None
    if cfg.get("hidden_act", "silu") != "silu":
        raise KvcliError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported (Llama uses 'silu')")
    gguf_arch = GGUF_ARCH[archs[0]]
    # Qwen2's q,k,v biases are part of its architecture (transformers ignores attention_bias there)
    for key in ("attention_bias", "mlp_bias") if gguf_arch != "qwen2" else ("mlp_bias",):
        if cfg.get(key):
            raise KvcliError(f"config.json: {key} = true is not supported ({archs[0]} runs without those biases)")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None  # Qwen's switch
    if window is not None and (ctx is None or not isinstance(window, int) or window < ctx):
        raise KvcliError(f"config.json: sliding_window {window} (smaller than the context, "
                         f"max_position_embeddings {ctx}) is not supported")

    # transformers < 5 writes rope_theta + rope_scaling; 5 writes rope_parameters. Either may be null.
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(cfg.get(key) or {}, dict):
            raise KvcliError(f"config.json: {key} must be an object, got {cfg[key]!r}")
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    rope["rope_type"] = str(rope.get("rope_type", rope.get("type")) or "default")
    if rope["rope_type"] not in ROPE_TYPES:
        raise KvcliError(f"RoPE scaling {rope['rope_type']!r} is not supported "
                         f"(convert supports {', '.join(ROPE_TYPES)})")
    if rope["rope_type"] == "yarn" and rope.get("factor") is not None:
        orig = rope.get("original_max_position_embeddings", cfg.get("original_max_position_embeddings"))
        if isinstance(orig, bool) or not isinstance(orig, int) or orig <= 0:
            raise KvcliError(f"config.json: yarn RoPE scaling needs original_max_position_embeddings, got {orig!r}")
        rope["original_max_position_embeddings"] = orig
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise KvcliError(f"config.json: rope_theta must be a number, got {theta!r}")
    return HParams(arch=archs[0], gguf_arch=gguf_arch, n_layers=pos_int("num_hidden_layers"), n_embd=n_embd,
                   n_ff=pos_int("intermediate_size"),
                   n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim, vocab_size=pos_int("vocab_size"),
                   context_length=ctx, rms_eps=number("rms_norm_eps", 1e-6), rope_theta=float(theta), rope=rope,
                   tied=bool(cfg.get("tie_word_embeddings", False)), explicit_head_dim=explicit)


# --- weights --------------------------------------------------------------------------------------

class Checkpoint:
    """Tensor names, shapes and dtypes from safetensors headers or mmap'd torch .bin files;
    `load(name)` reads one tensor. Nothing is loaded up front."""

    def __init__(self, hf_dir: Path):
        self.files: dict[str, Path] = {}  # tensor name -> file
        self._handles: dict[Path, Any] = {}
        st_files, bin_files = _weight_files(hf_dir, "model.safetensors", "safetensors"), []
        if not st_files:
            bin_files = _weight_files(hf_dir, "pytorch_model.bin", "bin")
        if not st_files and not bin_files:
            raise KvcliError(f"no weights in {hf_dir}: need *.safetensors or pytorch_model*.bin")
        for path in st_files:
            self._open_safetensors(path)
        for path in bin_files:
            self._open_bin(path)

    def _open_safetensors(self, path: Path) -> None:
        from safetensors import SafetensorError, safe_open

        try:
            handle = safe_open(str(path), framework="pt")
            names = list(handle.keys())
        except (SafetensorError, OSError) as e:
            raise KvcliError(f"cannot read {path.name}: {e}") from None
        self._handles[path] = handle
        self.files.update(dict.fromkeys(names, path))

    def _open_bin(self, path: Path) -> None:
        import pickle

        import torch

        # weights_only: plain tensors only, never arbitrary pickled code; mmap: nothing is read yet
        try:
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # legacy (pre-zip) files cannot be memory-mapped; read this one shard
                state = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise KvcliError(f"{path.name} holds more than tensors; refusing to unpickle it (weights_only)") from None
        except (RuntimeError, OSError, EOFError, KeyError, ValueError) as e:
            raise KvcliError(f"cannot read {path.name} as a torch checkpoint: {type(e).__name__}") from None
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise KvcliError(f"{path.name} is not a state dict of tensors")
        self._handles[path] = state
        self.files.update(dict.fromkeys(state, path))

    def shape_dtype(self, name: str) -> tuple[tuple[int, ...], str]:
        """(shape, dtype name like 'F32'/'BF16') without loading the data."""
        import torch

        handle = self._handles[self.files[name]]
        if isinstance(handle, dict):
            t = handle[name]
            names = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}
            return tuple(t.shape), names.get(t.dtype, str(t.dtype).removeprefix("torch."))
        s = handle.get_slice(name)
        return tuple(s.get_shape()), s.get_dtype()

    def load(self, name: str) -> np.ndarray:
        """One tensor as float32 numpy (bf16 has no numpy dtype, so it goes through torch)."""
        handle = self._handles[self.files[name]]
        t = handle[name] if isinstance(handle, dict) else handle.get_tensor(name)
        return t.float().numpy()


def _weight_files(hf_dir: Path, single: str, ext: str) -> list[Path]:
    """The shards named by `{single}.index.json`, else `{single}`, else every *.{ext} in the directory."""
    index = hf_dir / f"{single}.index.json"
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise KvcliError(f"malformed {index.name}: no weight_map")
        files = [hf_dir / f for f in dict.fromkeys(weight_map.values())]
        for f in files:
            if not f.is_file():
                raise KvcliError(f"{index.name} names {f.name}, which is missing from {hf_dir}")
        return files
    if (hf_dir / single).is_file():
        return [hf_dir / single]
    return sorted(p for p in hf_dir.glob(f"*.{ext}") if p.is_file())


# --- the tensor plan ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Item:
    name: str                       # GGUF tensor name
    shape: tuple[int, ...]          # torch (rows, cols) order
    qtype: Any                      # gguf.GGMLQuantizationType written
    load: Callable[[], np.ndarray]  # float32 data, rows already in GGUF order

    @property
    def nbytes(self) -> int:
        import gguf

        block, size = gguf.GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * size


_LAYER_NAMES = {  # HF suffix -> GGUF suffix, per block
    "input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


_QWEN2_NAMES = {"self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
                "self_attn.v_proj.bias": "attn_v.bias"}
_QWEN3_NAMES = {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}


def _expected(h: HParams) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF tensor name -> (GGUF name, torch shape implied by config.json)."""
    q, kv = h.n_heads * h.head_dim, h.n_kv_heads * h.head_dim
    out = {"model.embed_tokens.weight": ("token_embd.weight", (h.vocab_size, h.n_embd)),
           "model.norm.weight": ("output_norm.weight", (h.n_embd,))}
    if not h.tied:
        out["lm_head.weight"] = ("output.weight", (h.vocab_size, h.n_embd))
    shapes = {"attn_norm.weight": (h.n_embd,), "attn_q.weight": (q, h.n_embd), "attn_k.weight": (kv, h.n_embd),
              "attn_v.weight": (kv, h.n_embd), "attn_output.weight": (h.n_embd, q), "ffn_norm.weight": (h.n_embd,),
              "ffn_gate.weight": (h.n_ff, h.n_embd), "ffn_up.weight": (h.n_ff, h.n_embd),
              "ffn_down.weight": (h.n_embd, h.n_ff), "attn_q.bias": (q,), "attn_k.bias": (kv,), "attn_v.bias": (kv,),
              "attn_q_norm.weight": (h.head_dim,), "attn_k_norm.weight": (h.head_dim,)}
    names = _LAYER_NAMES | {"qwen2": _QWEN2_NAMES, "qwen3": _QWEN3_NAMES}.get(h.gguf_arch, {})
    for i in range(h.n_layers):
        for hf, g in names.items():
            out[f"model.layers.{i}.{hf}"] = (f"blk.{i}.{g}", shapes[g])
    return out


def _out_type(outtype: str, gguf_name: str, shape: tuple[int, ...], h: HParams) -> Any:
    """llama.cpp's rule: 1-D tensors (norms) stay F32; 2-D weights take the outtype, and a quantized
    type whose block does not divide the row length falls back to F16. For q4_0 the output head
    (token_embd when tied) stays Q8_0: llama-quantize keeps it at 6 bits, gguf.quants has no Q6_K."""
    import gguf

    T = gguf.GGMLQuantizationType
    if len(shape) < 2:
        return T.F32
    qtype = {"f32": T.F32, "f16": T.F16, "bf16": T.BF16, "q8_0": T.Q8_0, "q4_0": T.Q4_0}[outtype]
    head = "token_embd.weight" if h.tied else "output.weight"
    if qtype == T.Q4_0 and gguf_name == head:
        qtype = T.Q8_0
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return T.F16
    return qtype


def _llama3_rope_factors(h: HParams) -> np.ndarray:
    """Per-frequency RoPE divisors for rope_type llama3 (llama.cpp's generate_extra_tensors), (head_dim/2,)."""
    r = h.rope
    factor = float(r.get("factor", 8.0))
    lo, hi = float(r.get("low_freq_factor", 1.0)), float(r.get("high_freq_factor", 4.0))
    old_ctx = float(r.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / (h.rope_theta ** (np.arange(0, h.head_dim, 2, dtype=np.float32) / h.head_dim))
    out = []
    for wavelen in 2 * math.pi / freqs:
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def plan_tensors(h: HParams, ckpt: Checkpoint, outtype: str) -> list[Item]:
    """Check every checkpoint tensor against config.json and decide its GGUF name and type."""
    expected = _expected(h)
    ignored = {"lm_head.weight"} if h.tied else set()  # transformers ties it to embed_tokens anyway
    for name in ckpt.files:
        if name not in expected and name not in ignored and not name.endswith("rotary_emb.inv_freq"):
            raise KvcliError(f"unexpected tensor {name} in the checkpoint (not a {h.n_layers}-layer {h.arch} layout)")
    items = []
    if h.rope["rope_type"] == "llama3":
        factors = _llama3_rope_factors(h)
        items.append(Item("rope_freqs.weight", factors.shape, _out_type(outtype, "", factors.shape, h),
                          lambda: factors))
    for hf_name, (gguf_name, shape) in expected.items():
        if hf_name not in ckpt.files:
            raise KvcliError(f"checkpoint lacks tensor {hf_name}")
        got, dtype = ckpt.shape_dtype(hf_name)
        if got != shape:
            raise KvcliError(f"tensor {hf_name} has shape {list(got)}, config.json implies {list(shape)}")
        if dtype not in ("F32", "F16", "BF16"):
            raise KvcliError(f"tensor {hf_name} has unsupported dtype {dtype} (convert reads F32, F16, BF16)")
        heads = {"attn_q.weight": h.n_heads, "attn_k.weight": h.n_kv_heads}.get(gguf_name.split(".", 2)[-1], 0)
        heads = heads if h.gguf_arch == "llama" else 0  # qwen: rows as Hugging Face has them (NEOX RoPE)

        def load(hf_name=hf_name, heads=heads):
            w = ckpt.load(hf_name)
            return permute_qk(w, heads) if heads else w

        items.append(Item(gguf_name, shape, _out_type(outtype, gguf_name, shape, h), load))
    return items


def _encode(item: Item) -> np.ndarray:
    import gguf

    data = np.ascontiguousarray(item.load(), dtype=np.float32)
    if item.qtype == gguf.GGMLQuantizationType.F32:
        return data
    if item.qtype == gguf.GGMLQuantizationType.F16:
        return data.astype(np.float16)
    return gguf.quants.quantize(data, item.qtype)


# --- the file -------------------------------------------------------------------------------------

def _add_metadata(w: Any, h: HParams, hf_dir: Path, outtype: str) -> None:
    import gguf

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
             "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[outtype]
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(hf_dir.resolve().name)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_file_type(ftype)
    w.add_vocab_size(h.vocab_size)
    w.add_block_count(h.n_layers)
    if h.context_length is not None:
        w.add_context_length(h.context_length)
    w.add_embedding_length(h.n_embd)
    w.add_feed_forward_length(h.n_ff)
    w.add_head_count(h.n_heads)
    w.add_head_count_kv(h.n_kv_heads)
    w.add_rope_freq_base(h.rope_theta)
    w.add_layer_norm_rms_eps(h.rms_eps)
    if h.gguf_arch == "llama":  # LlamaModel writes it; llama.cpp's Qwen2Model/Qwen3Model do not (n_rot = head size)
        w.add_rope_dimension_count(h.head_dim)
    if h.explicit_head_dim:  # as llama.cpp: only when config.json names it
        w.add_key_length(h.head_dim)
        w.add_value_length(h.head_dim)
    r = h.rope
    if r["rope_type"] == "linear" and r.get("factor") is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(r["factor"]))
    elif r["rope_type"] == "yarn" and r.get("factor") is not None:  # llama.cpp's TextModel: the optional keys as given
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(r["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(r["original_max_position_embeddings"]))
        if r.get("extrapolation_factor") is not None:
            w.add_rope_scaling_yarn_ext_factor(float(r["extrapolation_factor"]))
        if r.get("attention_factor", r.get("attn_factor")) is not None:
            w.add_rope_scaling_yarn_attn_factor(float(r.get("attention_factor", r.get("attn_factor"))))
        if r.get("beta_fast") is not None:
            w.add_rope_scaling_yarn_beta_fast(float(r["beta_fast"]))
        if r.get("beta_slow") is not None:
            w.add_rope_scaling_yarn_beta_slow(float(r["beta_slow"]))


def _default_log(line: str) -> None:
    print(line, file=sys.stderr)


# `.OUT.<pid>.<8 hex>.tmp`, the name convert_hf writes under before renaming into place.
_TEMP_NAME = re.compile(r"^\..+\.(\d{1,7})\.[0-9a-f]{8}\.tmp$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: alive, someone else's
        return True
    return True


def remove_stale_temps(directory: Path, log: Callable[[str], None]) -> None:
    """Delete temporary files left in `directory` by a convert that was killed (SIGKILL, power loss:
    no handler runs). Only names of our pattern whose writer's pid is gone; a live writer's stay."""
    for path in directory.glob(".*.tmp"):
        m = _TEMP_NAME.match(path.name)
        if not m or int(m[1]) in (0, os.getpid()) or _pid_alive(int(m[1])):
            continue
        try:
            path.unlink()
        except FileNotFoundError:  # another convert cleaned it first
            continue
        log(f"removed {path.name}, left by an interrupted convert (pid {m[1]} is gone)")


def default_out_name(hf_dir: Path, items: list[Item], outtype: str) -> str:
    """llama.cpp's convert_hf_to_gguf.py default file name, by gguf-py's naming convention:
    `<name>[-<size label>]-<OUTTYPE>.gguf` (SmolLM2-135M-Instruct -> SmolLM2-135M-Instruct-F16.gguf;
    tiny -> tiny-137K-F16.gguf). Simpler than llama.cpp's: the name is the directory's as written
    (llama.cpp also reads the model card, title-cases), counted size label only where it has none."""
    import gguf

    name = hf_dir.resolve().name.strip().replace(" ", "-") or None  # None: llama.cpp's "ggml-model"
    has_size = name is not None and gguf.Metadata.get_model_id_components(name)[5] is not None
    size = None if has_size else gguf.size_label(sum(math.prod(i.shape) for i in items), 0, 0, 0)
    return f"{gguf.naming_convention(name, None, None, None, size, outtype.upper())}.gguf"


def _check_out(out: Path, force: bool) -> None:
    if out.is_dir():
        raise KvcliError(f"output path is a directory: {out}")
    if out.exists() and not force:
        raise KvcliError(f"{out} exists; pass --force to overwrite it")
    if not out.parent.is_dir():
        raise KvcliError(f"output directory does not exist: {out.parent}")


def convert_hf(hf_dir: str | os.PathLike, out_path: str | os.PathLike | None = None, outtype: str = "f16",
               force: bool = False, progress: bool = True, log: Callable[[str], None] | None = None) -> Path:
    """Convert a Hugging Face Llama/Mistral/Qwen2/Qwen3 directory to `out_path` (GGUF); returns the path written.
    `out_path` None or a directory: `default_out_name` in the model directory or that one, as llama.cpp.

    Writes `.OUT.<pid>.<hex>.tmp` next to OUT and renames it into place only when complete; any failure
    (or Ctrl-C) removes the temporary file and leaves OUT untouched. A convert killed outright (SIGKILL)
    leaves its temporary file; the next convert into that directory removes it (its pid is gone)."""
    import gguf

    log = log or _default_log
    hf_dir, out = Path(hf_dir), (Path(out_path) if out_path is not None else None)
    if outtype not in OUTTYPES:
        raise KvcliError(f"unknown --outtype {outtype!r}; choose {', '.join(OUTTYPES)}")
    if not hf_dir.exists():
        raise KvcliError(f"model directory not found: {hf_dir}")
    if not hf_dir.is_dir():
        raise KvcliError(f"not a directory: {hf_dir} (give the Hugging Face model directory)")
    if out is not None and not out.is_dir():  # a file name given is checked before reading anything
        _check_out(out, force)

    h = read_hparams(hf_dir)
    items = plan_tensors(h, Checkpoint(hf_dir), outtype)
    if out is None or out.is_dir():  # the default name counts parameters: known once tensors are planned
        out = (out or hf_dir) / default_out_name(hf_dir, items, outtype)
        _check_out(out, force)
    remove_stale_temps(out.parent, log)
    # next to OUT so that os.replace is an atomic rename on one file system
    tmp = out.parent / f".{out.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    writer = gguf.GGUFWriter(tmp, h.gguf_arch)
    try:
        _add_metadata(writer, h, hf_dir, outtype)
        log(add_vocab(writer, hf_dir, h.vocab_size, log))
        for item in items:  # the tensor table is written from shapes alone; data follows one tensor at a time
            writer.add_tensor_info(item.name, item.shape, np.dtype(np.float32), item.nbytes, raw_dtype=item.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        _write_tensors(writer, items, progress)
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    total = sum(i.nbytes for i in items)
    log(f"wrote {out} ({outtype}, {len(items)} tensors, {total / MIB:.1f} MiB of weights)")
    return out


def _write_tensors(writer: Any, items: list[Item], progress: bool) -> None:
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    columns = (TextColumn("{task.description:<24}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), disable=not progress, transient=False) as bar:
        task = bar.add_task("converting", total=sum(i.nbytes for i in items))
        for item in items:
            bar.update(task, description=item.name)
            data = _encode(item)
            if data.nbytes != item.nbytes:  # guards the table written before the data
                raise KvcliError(f"internal: {item.name} encoded to {data.nbytes} bytes, expected {item.nbytes}")
            writer.write_tensor_data(data)
            bar.advance(task, item.nbytes)
            del data
