"""Tokenizers built from GGUF metadata, reproducing llama.cpp's llama-vocab.cpp.

Two vocabulary kinds are supported (``tokenizer.ggml.model``):

* ``llama`` (SentencePiece): the pieces are packed into a SentencePiece BPE ``ModelProto`` and run by
  ``sentencepiece``. llama.cpp does no normalisation of its own beyond ``' '`` -> ``'▁'`` and a space
  prefix, so we do exactly that here and give SentencePiece an identity normaliser.
* ``gpt2`` (byte-level BPE): kvcli/bpe.py, words cut by the regexes llama.cpp applies for the file's
  ``tokenizer.ggml.pre`` name (kvcli/pretokenizers.py), then merged on the packed vocabulary.

Special tokens follow llama.cpp: user-defined tokens (type 4) are always matched whole in the text,
control tokens (type 3) only with ``parse_special=True``. Decoding goes through ``token_to_bytes`` so
that ``decode`` and the streaming decoder agree byte for byte.
"""

from __future__ import annotations

import codecs
import json
import re
import struct
from datetime import datetime
from typing import Any, Mapping, Sequence

from kvcli.bpe import ByteLevelBPE, bytes_to_unicode
from kvcli.errors import KvcliError
from kvcli.packed_strings import PackedStrings
from kvcli.pretokenizers import for_onig, pre_tokenizer

# ggml token types (llama.cpp's llama_token_type); SentencePiece's piece types use the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as end-of-generation (special_eog_ids), plus the FIM pad/repo/sep
# tokens it also adds there. (Its EOT auto-detection by text only finds texts already listed here.)
_EOG_TEXTS = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
    "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>", "<end_of_utterance>",
    "<eos>", "<｜end▁of▁sentence｜>",
}
_FIM_EOG_TEXTS = {"<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]", "<|fim_repo|>", "<|repo_name|>",
                  "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>"}


_UNICODE_TO_BYTE = {c: b for b, c in bytes_to_unicode().items()}


def _pb_varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _pb(field: int, value: bytes | int | float | str) -> bytes:
    """One protobuf field. Hand-rolled so that we need no `protobuf` package for SentencePiece's proto."""
    if isinstance(value, float):
        return _pb_varint(field << 3 | 5) + struct.pack("<f", value)
    if isinstance(value, int):
        return _pb_varint(field << 3) + _pb_varint(value)
    if isinstance(value, str):
        value = value.encode("utf-8")
    return _pb_varint(field << 3 | 2) + _pb_varint(len(value)) + value


def _spm_model_proto(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> bytes:
    """A serialized sentencepiece ModelProto (field numbers from sentencepiece_model.proto)."""
    pieces = b"".join(_pb(1, _pb(1, t) + _pb(2, float(s)) + _pb(3, ty)) for t, s, ty in zip(tokens, scores, types))
    trainer = _pb(3, 2) + _pb(35, int(BYTE in types))  # model_type = BPE (llama.cpp merges by score), byte_fallback
    # identity normaliser, no dummy prefix, keep whitespace, no escaping: encode() does llama.cpp's own escaping.
    normalizer = _pb(1, "identity") + _pb(3, 0) + _pb(4, 0) + _pb(5, 0)
    return pieces + _pb(2, trainer) + _pb(3, normalizer)


def _token_id(meta: Mapping[str, Any], key: str, default: int | None, n: int) -> int | None:
    value = meta.get(f"tokenizer.ggml.{key}", default)
    return int(value) if value is not None and 0 <= int(value) < n else None


class Tokenizer:
    """A llama.cpp-compatible tokenizer for one GGUF file. Build it with `Tokenizer.from_metadata`."""

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> "Tokenizer":
        return cls(meta)

    def __init__(self, meta: Mapping[str, Any]):
        self.model = meta.get("tokenizer.ggml.model")
        if self.model not in ("llama", "gpt2"):
            raise KvcliError(f"unsupported tokenizer.ggml.model {self.model!r}; supported: 'llama', 'gpt2'")
        if not meta.get("tokenizer.ggml.tokens"):
            raise KvcliError("GGUF metadata lacks tokenizer.ggml.tokens (the vocabulary)")
        tokens = meta["tokenizer.ggml.tokens"]  # a file's: packed (kvcli/packed_strings.py), shared with its metadata
        self.tokens: Sequence[str] = tokens if isinstance(tokens, PackedStrings) else list(tokens)
        n = self.vocab_size = len(self.tokens)
        self.types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * n)
        self.chat_template: str | None = meta.get("tokenizer.chat_template")
        spm = self.model == "llama"
        # llama.cpp's defaults when the ids are absent: 1/2 for SentencePiece, none for BPE files.
        self.bos_id = _token_id(meta, "bos_token_id", 1 if spm else None, n)
        self.eos_id = _token_id(meta, "eos_token_id", 2 if spm else None, n)
        self.add_space_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", spm)) and spm

        # user-defined tokens are always split out of the text, control/unknown ones only when asked.
        self._always = [i for i, t in enumerate(self.types) if t == USER_DEFINED and self.tokens[i]]
        self._special = [i for i, t in enumerate(self.types) if t in (CONTROL, UNKNOWN) and self.tokens[i]]
        if spm:
            # llama.cpp's SPM merges into any piece whatever its type (and keeps unused ones whole, which
            # sentencepiece splits again), so sentencepiece sees every piece as normal but the byte pieces
            # (its byte fallback) and the one unknown piece it requires (phi-3 has 53 unknown-typed ones).
            types = [BYTE if t == BYTE else NORMAL for t in self.types]
            types[_token_id(meta, "unknown_token_id", 0, n) or 0] = UNKNOWN
            import sentencepiece

            scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
            try:
                self._sp = sentencepiece.SentencePieceProcessor(model_proto=_spm_model_proto(self.tokens, scores, types))
            except (RuntimeError, TypeError, ValueError) as e:
                raise KvcliError(f"bad SentencePiece vocabulary in GGUF metadata: {str(e)[:100]}") from None
            default_bos = True
        else:
            pre = pre_tokenizer(meta.get("tokenizer.ggml.pre") or "default")
            default_bos = pre.add_bos
            merges = PackedStrings.of(meta.get("tokenizer.ggml.merges") or [])
            self._bpe = ByteLevelBPE(PackedStrings.of(self.tokens), merges, [for_onig(r) for r in pre.regexes],
                                     pre.ignore_merges)
        # parse_special -> (regex splitting out the tokens matched whole, their text -> id)
        self._split = {ps: self._splitter(self._always + (self._special if ps else [])) for ps in (False, True)}
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)) and self.bos_id is not None
        # the ids of the texts that end a generation (a text twice: its last id, as llama.cpp's text -> id map)
        self.eog_ids: frozenset[int] = self._eog_ids(meta, {t: i for i, t in enumerate(self.tokens) if t in _EOG_TEXTS
                                                            or t in _FIM_EOG_TEXTS})

    def _splitter(self, ids: list[int]) -> tuple[re.Pattern | None, dict[str, int]]:
        by_text = {self.tokens[i]: i for i in ids}
        texts = sorted(by_text, key=len, reverse=True)  # longest first, as llama.cpp tries them
        return (re.compile("(" + "|".join(map(re.escape, texts)) + ")") if texts else None), by_text

    def _eog_ids(self, meta, by_text: dict[str, int]) -> frozenset[int]:
        n, ids = self.vocab_size, set()
        for key in ("fim_pad_token_id", "fim_rep_token_id", "fim_sep_token_id", "eot_token_id", "eom_token_id"):
            if (i := _token_id(meta, key, None, n)) is not None:
                ids.add(i)
        ids.update(by_text.values())
        if self.eos_id is not None:
            ids.add(self.eos_id)
        # gpt-oss style vocabularies: "<|end|>" ends a message, not the generation, when <|return|>/<|call|> exist
        if "<|return|>" in by_text and "<|call|>" in by_text and "<|end|>" in by_text:
            ids.discard(by_text["<|end|>"])
        return frozenset(ids)

    # --- encoding -----------------------------------------------------------------------------------

    def encode(self, text: str, add_bos: bool | None = None, parse_special: bool = False) -> list[int]:
        """Token ids for `text`; BOS first when `add_bos` (default: the file's add_bos_token)."""
        ids = [self.bos_id] if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None else []
        # Special tokens split out first (llama.cpp's tokenizer_st_partition), then each fragment between them: BPE,
        # or SentencePiece as llama.cpp's llm_tokenizer_spm, which gives every fragment that starts the prompt or
        # follows a special token a leading space, and escapes spaces.
        (split, by_text), prev_special = self._split[parse_special], True
        for k, part in enumerate(split.split(text) if split else [text]):
            if k % 2:  # odd parts are the separators the capturing group kept: special tokens
                ids.append(by_text[part])
                prev_special = True
            elif part and self.model == "gpt2":
                ids += self._bpe.encode(part)
            elif part:
                part = (" " if self.add_space_prefix and prev_special else "") + part
                ids += self._sp.encode(part.replace(" ", "\u2581"))
                prev_special = False
        return ids

    # --- decoding -----------------------------------------------------------------------------------

    def _type(self, id: int) -> int:
        """The token type of `id`; KvcliError outside the vocabulary (a negative id would otherwise
        index from the end)."""
        if not 0 <= id < self.vocab_size:
            raise KvcliError(f"token id {id} is outside the vocabulary: ids run 0..{self.vocab_size - 1}")
        return self.types[id]

    def token_to_bytes(self, id: int) -> bytes:
        """The raw bytes of one token's text, as llama.cpp's token_to_piece(special=True)."""
        kind, text = self._type(id), self.tokens[id]
        if kind == BYTE:  # "<0x0A>"
            return bytes([int(text[3:-1], 16)])
        if kind != NORMAL:
            return text.encode("utf-8")
        if self.model == "llama":
            return text.replace("\u2581", " ").encode("utf-8")
        return b"".join(bytes([_UNICODE_TO_BYTE[c]]) if c in _UNICODE_TO_BYTE else c.encode("utf-8") for c in text)

    def _visible_bytes(self, id: int, special: bool) -> bytes:
        # llama.cpp hides control and unknown tokens unless special=True, and never renders unused ones.
        kind = self._type(id)
        if kind == UNUSED or (not special and kind in (CONTROL, UNKNOWN)):
            return b""
        return self.token_to_bytes(id)

    def decode(self, ids: Sequence[int], special: bool = False) -> str:
        """Text of `ids`. Control tokens (BOS, EOS, <|im_end|>, ...) are dropped unless `special`.

        For SentencePiece vocabularies with a space prefix, the one leading space encode() added is
        removed, so decode(encode(s)) == s (SentencePiece/HF behaviour; llama.cpp keeps it after a BOS).
        """
        out = b"".join(self._visible_bytes(int(i), special) for i in ids).decode("utf-8", errors="replace")
        if self.add_space_prefix and out.startswith(" "):
            out = out[1:]
        return out

    def stream(self, special: bool = False) -> "StreamDecoder":
        """An incremental decoder for generated ids (no leading-space removal: it continues a prompt)."""
        return StreamDecoder(self, special)

    # --- chat ---------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render the file's chat template like transformers does (sandboxed jinja2)."""
        if not self.chat_template:
            raise KvcliError("this model has no chat template (tokenizer.chat_template is missing)")
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        tok = lambda i: self.tokens[i] if i is not None else ""  # noqa: E731
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=tok(self.bos_id), eos_token=tok(self.eos_id))
        except TemplateError as e:
            raise KvcliError(f"chat template failed: {e}") from e


class StreamDecoder:
    """Turns ids into text as they arrive, holding back bytes of a character not yet complete."""

    def __init__(self, tokenizer: Tokenizer, special: bool = False):
        self._tok, self._special = tokenizer, special
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        return self._utf8.decode(self._tok._visible_bytes(int(id), self._special))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)
