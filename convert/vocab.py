"""Hugging Face tokenizer files -> `tokenizer.ggml.*` GGUF keys, as llama.cpp's converter writes them.

* `tokenizer.model` (SentencePiece): pieces, scores and piece types (`_set_vocab_sentencepiece`).
* `tokenizer.json` with a byte-level BPE model: tokens, token types, merges and the pre-tokenizer
  name llama.cpp picks by hashing the token ids of a fixed check string (`get_vocab_base_pre`).
Special token ids, add-BOS/EOS flags and the chat template come through gguf-py's `SpecialVocab`.
"""

from __future__ import annotations

import json
from hashlib import sha256
from pathlib import Path
from typing import Any, Callable

from kvcli.errors import KvcliError

# ggml token types (llama.cpp's llama_token_type); SentencePiece piece types use the same numbers.
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# llama.cpp's check string (convert_hf_to_gguf_update.py): its token ids identify a BPE pre-tokenizer.
CHKTXT = '\n \n\n \n\n\n \t \t\t \t\n  \n   \n    \n     \n🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 3 33 333 3333 33333 333333 3333333 33333333 3.3 3..3 3...3 កាន់តែពិសេសអាច😁 ?我想在apple工作1314151天～ ------======= нещо на Български \'\'\'\'\'\'```````""""......!!!!!!?????? I\'ve been \'told he\'s there, \'RE you sure? \'M not sure I\'ll make it, \'D you like some tea? We\'Ve a\'lL'

# sha256(str(ids of CHKTXT)) -> tokenizer.ggml.pre, copied from llama.cpp's get_vocab_base_pre for the
# names kvcli's tokenizer runs. (The hashes are of `tokenizer.encode(CHKTXT)`, special tokens included.)
PRE_BY_HASH = {
    "b6e8e1518dc4305be2fe39c313ed643381c4da5db34a98f6a04c093f8afbe99b": "chatglm-bpe",  # THUDM/glm-4-9b-chat
    "81d72c7348a9f0ebe86f23298d37debe0a5e71149e29bd283904c02262b27516": "chatglm-bpe",  # THUDM/glm-4-9b-chat
    "1431a23e583c97432bc230bff598d103ddb5a1f89960c8f1d1051aaa944d0b35": "minerva-7b",  # sapienzanlp/Minerva-7B-base-v1.0
    "7e57df22b1fe23a7b1e1c7f3dc4e3f96d43a4eb0836d0c6bdc3436d7b2f1c664": "hunyuan",  # tencent/Hunyuan-A13B-Instruct
    "a6b57017d60e6edb4d88ecc2845188e0eb333a70357e45dcc9b53964a73bbae6": "falcon-h1",  # tiiuae/Falcon-H1-0.5B-Base
    "60476e1243776c4fb1b993dbd7a5f15ac22f83c80afdf425fa5ae01c8d44ef86": "falcon-h1",  # tiiuae/Falcon-H1-1B-Base
    "3eda48b4c4dc7de733d1a8b3e3b4a85243dbbf704da2ee9d42c6beced8897896": "falcon-h1",  # tiiuae/Falcon-H1-7B-Base
    "48f8e02c0359c0bbdd82f26909171fac1c18a457bb47573ed1fe3bbb2c1cfd4b": "falcon-h1",  # tiiuae/Falcon-H1-34B-Base
    "d4540891389ea895b53b399da6ac824becc30f2fba0e9ddbb98f92e55ca0e97c": "qwen2",  # Qwen/Qwen3-Embedding-0.6B
    "66b8d4e19ab16c3bfd89bce5d785fb7e0155e8648708a1f42077cb9fe002c273": "grok-2",  # alvarobartt/grok-2-tokenizer
    "0fe1cf6eda062318a1af7270f3331a85c539a01778ff948e24388e949c5282f4": "gpt-2",  # evilfreelancer/ruGPT3XL
    "9e454714343b69b99b71795c1d27a68c2a1d15dab111f4d353109f966af29da7": "lfm2",  # LiquidAI/LFM2.5-8B-A1B
    "0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5": "llama-bpe",  # meta-llama/Meta-Llama-3-8B
    "8aeee3860c56296a157a1fe2fad249ec40aa59b1bb5709f4ade11c4e6fe652ed": "falcon",  # tiiuae/falcon-7b
    "9d032fcbd5501f4a38150912590928bfb36091efb5df11b8e2124b0390e3fb1e": "falcon3",  # tiiuae/Falcon3-7B-Base
    "b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166": "mpt",  # mosaicml/mpt-7b
    "35d91631860c815f952d711435f48d356ebac988362536bed955d43bfa436e34": "starcoder",  # bigcode/starcoder2-3b
    "3ce83efda5659b07b1ad37ca97ca5797ea4285d9b9ab0dc679e4a720c9da7454": "gpt-2",  # openai-community/gpt2
    "32d85c31273f8019248f2559fed492d929ea28b17e51d81d3bb36fff23ca72b3": "stablelm2",  # stabilityai/stablelm-2-zephyr-1_6b
    "6221ad2852e85ce96f791f476e0b390cf9b474c9e3d1362f53a24a06dc8220ff": "refact",  # smallcloudai/Refact-1_6-base
    "9c2227e4dd922002fb81bde4fc02b0483ca4f12911410dee2255e4987644e3f8": "command-r",  # CohereForAI/c4ai-command-r-v01
    "e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea": "qwen2",  # Qwen/Qwen1.5-7B
    "a8594e3edff7c29c003940395316294b2c623e09894deebbc65f33f1515df79e": "dbrx",  # databricks/dbrx-base
    "c136ed14d01c2745d4f60a9596ae66800e2b61fa45643e72436041855ad4089d": "smaug-bpe",  # abacusai/Smaug-Llama-3-70B-Instruct
    "b53802fb28e26d645c3a310b34bfe07da813026ec7c7716883404d5e0f8b1901": "jais",  # core42/jais-13b
    "7b3e7548e4308f52a76e8229e4e6cc831195d0d1df43aed21ac6c93da05fec5f": "codeshell",  # WisdomShell/CodeShell-7B
    "855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249": "smollm",  # HuggingFaceTB/SmolLM-135M
    "4e2b24cc4770243d65a2c9ec19770a72f08cffc161adbb73fcbb6b7dd45a0aae": "exaone",  # LGAI-EXAONE/EXAONE-3.0-7.8B-Instruct
    "fcace8b9cac38ce847670c970cd5892031a753a1ef381abd1d9af00f713da085": "phi-2",  # microsoft/phi-2
    "d4c8f286ea6b520b3d495c4455483cfa2302c0cfcd4be05d781b6a8a0a7cdaf1": "megrez",  # Infinigence/Megrez-3B-Instruct
    "b3f499bb4255f8ca19fccd664443283318f2fd2414d5e0b040fbdd0cc195d6c5": "deepseek-r1-qwen",  # deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B
    "1994ffd01900cfb37395608534236ecd63f2bd5995d6cb1004dda1af50240f15": "trillion",  # trillionlabs/Trillion-7B-preview
    "0e9433cbbb161f89e264eb32e8e64bfe69e834973ffca5d41d3948a604a3e2a3": "pixtral",  # mistral-community/pixtral-12b
    "f6791d196f87ce6b56a7d234be618e0d58f8cda3549416635b2bebcd22cd95c4": "midm-2.0",  # K-intelligence/Midm-2.0-Base-Instruct
    "169bf0296a13c4d9b7672313f749eb36501d931022de052aad6e36f2bf34dd51": "lfm2",  # LiquidAI/LFM2.5-350M
    "2085e1638f6c377a0aa4ead21b27bb4cb941bf800df86ed391011769c1758dfb": "exaone4",  # LGAI-EXAONE/EXAONE-4.0-32B
    "53e325976a6e142379c19b09afcae354f2f496f147afa8f9e189a33fe4e3024e": "granite-docling",  # ibm-granite/granite-docling-258M
}

# Qwen2's pre-tokenizer regex as Qwen2/2.5/3 tokenizer.json files write it (a Split before a ByteLevel that
# has no regex of its own): a vocabulary retrained with it has an unknown hash but llama.cpp's 'qwen2' split.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")

# Token texts llama.cpp's converter marks CONTROL even when the tokenizer calls them non-special.
_LOOKS_SPECIAL = {"<pad>", "<mask>", "<2mass>", "[@BOS@]"}


def looks_special(text: str) -> bool:
    """llama.cpp's does_token_look_special: <|...|>, <｜...｜>, <unused...> and a few fixed names."""
    return (text in _LOOKS_SPECIAL or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>"))
            or (text.startswith("<unused") and text.endswith(">")))


def read_json(path: Path, required: bool = False) -> dict[str, Any]:
    """A JSON object from `path`; {} when absent and not required. Malformed -> one-line KvcliError."""
    if not path.is_file():
        if required:
            raise KvcliError(f"{path.name} not found in {path.parent}")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise KvcliError(f"malformed {path.name} in {path.parent}: {e.msg} "
                         f"at line {e.lineno}, column {e.colno}") from None
    except UnicodeDecodeError:
        raise KvcliError(f"malformed {path.name} in {path.parent}: not UTF-8 text") from None
    if not isinstance(data, dict):
        raise KvcliError(f"malformed {path.name} in {path.parent}: expected a JSON object, got {type(data).__name__}")
    return data


def add_vocab(writer: Any, hf_dir: Path, n_vocab: int, log: Callable[[str], None]) -> str:
    """Write the tokenizer keys for `hf_dir` into `writer`; returns a short description for the log."""
    import gguf

    tok_config = read_json(hf_dir / "tokenizer_config.json")
    if isinstance(tok_config.get("add_prefix_space"), bool):  # as llama.cpp's LlamaModel.set_vocab
        writer.add_add_space_prefix(tok_config["add_prefix_space"])
    if (hf_dir / "tokenizer.model").is_file():
        kind, tokens, scores, types = "llama", *_spm_vocab(hf_dir, n_vocab, tok_config)
        pre, merges = "default", False
    elif (hf_dir / "tokenizer.json").is_file():
        kind, (tokens, types, pre), scores, merges = "gpt2", _bpe_vocab(hf_dir, n_vocab, log), None, True
    else:
        raise KvcliError(f"no tokenizer in {hf_dir}: need tokenizer.model (SentencePiece) or tokenizer.json (BPE)")
    writer.add_tokenizer_model(kind)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if scores is not None:
        writer.add_token_scores(scores)
    writer.add_token_types(types)

    special = gguf.SpecialVocab(hf_dir, load_merges=merges, n_vocab=n_vocab)
    if merges and not special.merges:
        raise KvcliError(f"tokenizer.json in {hf_dir} has no BPE merges")
    if kind == "llama":
        # SpecialVocab maps tokenizer_config's "<s>"-style texts to ids only through tokenizer.json, so
        # with tokenizer.model alone it falls back to config.json's ids; the tokenizer's own texts win.
        first_id: dict[str, int] = {}
        for i, text in enumerate(tokens):
            first_id.setdefault(text, i)
        for typ in ("bos", "eos", "unk", "pad"):
            entry = tok_config.get(f"{typ}_token")
            text = entry.get("content") if isinstance(entry, dict) else entry
            if isinstance(text, str) and text in first_id:
                special.special_token_ids[typ] = first_id[text]
    # generation_config.json is the last word on BOS/EOS only where the tokenizer files say nothing;
    # its eos_token_id may be a list (Llama 3.1): the first one is the EOS token, the rest are EOG by text.
    gen = read_json(hf_dir / "generation_config.json")
    for typ in ("bos", "eos"):
        value = gen.get(f"{typ}_token_id")
        value = value[0] if isinstance(value, list) and value else value
        if typ not in special.special_token_ids and isinstance(value, int) and 0 <= value < n_vocab:
            special.special_token_ids[typ] = value
    special.add_to_gguf(writer, quiet=True)
    return f"{kind} vocab, {len(tokens)} tokens, pre-tokenizer {pre!r}"


def _spm_vocab(hf_dir: Path, n_vocab: int, tok_config: dict) -> tuple[list[str], list[float], list[int]]:
    """llama.cpp's _create_vocab_sentencepiece: pieces padded to vocab_size, then added tokens."""
    import sentencepiece

    path = hf_dir / "tokenizer.model"
    sp = sentencepiece.SentencePieceProcessor()
    try:
        sp.LoadFromFile(str(path))
    except (OSError, RuntimeError) as e:
        raise KvcliError(f"{path} is not a SentencePiece model: {str(e).splitlines()[0] if str(e) else e}") from None
    if sp.vocab_size() > n_vocab:
        raise KvcliError(f"tokenizer.model has {sp.vocab_size()} pieces but config.json says vocab_size {n_vocab}")
    tokens = [f"[PAD{i}]" for i in range(n_vocab)]
    scores, types = [-10000.0] * n_vocab, [UNUSED] * n_vocab
    for i in range(sp.vocab_size()):
        tokens[i], scores[i] = sp.IdToPiece(i), sp.GetScore(i)
        types[i] = (UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else UNUSED if sp.IsUnused(i)
                    else BYTE if sp.IsByte(i) else NORMAL)
    added = read_json(hf_dir / "added_tokens.json")
    for text, i in added.items():
        if isinstance(i, int) and 0 <= i < n_vocab:
            tokens[i], scores[i], types[i] = text, -1000.0, USER_DEFINED
    for key, entry in (tok_config.get("added_tokens_decoder") or {}).items():
        i, text = int(key), entry.get("content") if isinstance(entry, dict) else None
        if not isinstance(text, str) or not 0 <= i < n_vocab:
            continue
        if entry.get("special") or looks_special(text):
            types[i] = CONTROL
        else:  # llama.cpp pre-normalizes user-defined spaces
            text, types[i] = text.replace("\u2581", " "), USER_DEFINED
        tokens[i], scores[i] = text, -1000.0
    return tokens, scores, types


def _bpe_vocab(hf_dir: Path, n_vocab: int, log: Callable[[str], None]) -> tuple[list[str], list[int], str]:
    """llama.cpp's get_vocab_base through HF `tokenizers` (no transformers): tokens, types, pre name."""
    from tokenizers import Tokenizer

    path = hf_dir / "tokenizer.json"
    data = read_json(path)
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    if model.get("type") != "BPE":
        raise KvcliError(f"tokenizer.json has a {model.get('type')!r} model; convert reads BPE tokenizer.json "
                         "or a SentencePiece tokenizer.model")
    if model.get("byte_fallback"):
        raise KvcliError("tokenizer.json is a SentencePiece-style BPE (byte_fallback); put its tokenizer.model "
                         f"in {hf_dir}")
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception for files it cannot parse
        raise KvcliError(f"cannot read {path}: {e}") from None
    vocab = tok.get_vocab(with_added_tokens=True)
    if vocab and max(vocab.values()) >= n_vocab:
        raise KvcliError(f"tokenizer.json has token id {max(vocab.values())} but config.json says vocab_size {n_vocab}")
    added = {t["id"]: t for t in data.get("added_tokens") or [] if isinstance(t, dict) and "id" in t}
    by_id = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        text = by_id.get(i)
        if text is None:
            tokens.append(f"[PAD{i}]")
            types.append(UNUSED)
        elif i in added:
            if added[i].get("special") or looks_special(text):
                types.append(CONTROL)
            else:
                text = text.replace("\u2581", " ")
                types.append(USER_DEFINED)
            tokens.append(text)
        else:
            tokens.append(text)
            types.append(NORMAL)
    return tokens, types, detect_pre(tok, data, log)


def detect_pre(tok: Any, data: dict, log: Callable[[str], None]) -> str:
    """tokenizer.ggml.pre for a BPE tokenizer: llama.cpp's check-string hash first; then two structural
    rules (a lone GPT-2 ByteLevel pre-tokenizer, no normalizer -> 'gpt-2'; Qwen2's Split + regex-less
    ByteLevel -> 'qwen2'); else 'default' with a warning."""
    chkhsh = sha256(str(tok.encode(CHKTXT).ids).encode()).hexdigest()
    if chkhsh in PRE_BY_HASH:
        return PRE_BY_HASH[chkhsh]
    pre = data.get("pre_tokenizer") or {}
    parts = (pre.get("pretokenizers") or []) if pre.get("type") == "Sequence" else []
    split = parts[0] if len(parts) == 2 and parts[0].get("type") == "Split" else {}
    split_regex = (split.get("pattern") or {}).get("Regex")
    if split_regex == QWEN2_SPLIT and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True):
        return "qwen2"
    if pre.get("type") == "Sequence" and len(pre.get("pretokenizers") or []) == 1:
        pre = pre["pretokenizers"][0]
    if (data.get("normalizer") is None and pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
            and not pre.get("add_prefix_space", False)):
        return "gpt-2"
    log(f"warning: BPE pre-tokenizer not recognized (chkhsh {chkhsh[:16]}...); writing 'default', "
        "so tokenization may differ from the original tokenizer")
    return "default"
