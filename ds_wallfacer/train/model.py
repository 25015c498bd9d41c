"""The model and tokenizer a run trains: an HF directory, a ``config.json``, or a built-in preset.

- a directory with weights (``*.safetensors`` / ``pytorch_model*.bin``): ``from_pretrained``;
- a directory with only ``config.json``, or a path to a ``config.json``: random initialisation from the config;
- a preset name (``PRESETS``, plain data): a small Llama for demos and tests.

Random initialisation is seeded with ``--seed`` on every rank, so all ranks start from identical weights (the
sequence-parallel ranks must hold the same model; ZeRO broadcasts nothing at start). The tokenizer is the model
directory's when it has one, else byte-level (``byte_tokenizer``: token id = byte value, vocab 256).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..hf_config import text_config
from .cli import StartupError

__all__ = [
    "BYTE_EOS_ID", "PRESETS", "LoadedModel", "byte_tokenizer", "dtype_of", "load_model", "resolve_model_source",
]

PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": {
        "model_type": "llama", "vocab_size": 256, "hidden_size": 128, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "max_position_embeddings": 8192,
    },
    "small-llama": {
        "model_type": "llama", "vocab_size": 256, "hidden_size": 512, "intermediate_size": 1408,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4,
        "max_position_embeddings": 131072,
    },
}
"""Built-in models by name: HF config values (byte-level vocab)."""

BYTE_EOS_ID = 0
"""Document separator of the byte-level tokenizer (the NUL byte: it does not occur in text)."""
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass
class LoadedModel:
    """What ``load_model`` built."""

    model: torch.nn.Module
    tokenizer: Any
    """A ``PreTrainedTokenizerFast`` (byte-level when the model brings none)."""
    eos_id: int
    """Token joining documents."""
    source: str
    """Where the weights came from: "pretrained:<dir>", "config:<path>" or "preset:<name>"."""
    tokenizer_id: str
    """Identity of the tokenizer for the data cache key."""
    folder: Path | None = None
    """The model's folder (its tokenizer's, and a vision-language model's processor's); None for a preset."""


def resolve_model_source(spec: str) -> tuple[str, Path | None]:
    """``--model`` -> (kind, path): ("pretrained", dir), ("config", file) or ("preset", None). Pure (file system
    only), so every rank refuses a bad value identically before any collective."""
    path = Path(spec)
    if path.is_dir():
        if any(any(path.glob(p)) for p in _WEIGHTS):
            return "pretrained", path
        if (path / "config.json").is_file():
            return "config", path / "config.json"
        raise StartupError(f"--model {spec!r} is a directory without config.json: give an HF model directory "
                           "(save_pretrained layout), a config.json, or a preset name")
    if path.is_file():
        if path.suffix != ".json":
            raise StartupError(f"--model {spec!r} is a file but not a config.json")
        return "config", path
    if spec in PRESETS:
        return "preset", None
    raise StartupError(f"--model {spec!r} does not exist: give an HF model directory, a config.json, or a preset "
                       f"name ({', '.join(PRESETS)})")


def byte_tokenizer() -> Any:
    """A real HF tokenizer whose ids are the UTF-8 bytes of the text (BPE without merges over GPT-2's
    byte-to-unicode alphabet): saved with the exported model, it round-trips through ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # GPT-2's bytes_to_unicode order: byte b -> its printable stand-in; id = b
    byte_chars = _bytes_to_unicode()
    assert set(byte_chars.values()) == set(alphabet)
    vocab = {ch: b for b, ch in byte_chars.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=1 << 30)


def _bytes_to_unicode() -> dict[int, str]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _load_tokenizer(model_dir: Path | None) -> tuple[Any, str]:
    if model_dir is not None and any((model_dir / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        files = sorted(f for f in model_dir.iterdir() if f.name.startswith(("tokenizer", "vocab", "merges", "special")))
        ident = "hf:" + ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)
        return tok, ident
    return byte_tokenizer(), "bytes"


def dtype_of(ds_config: dict[str, Any]) -> torch.dtype:
    """Training dtype from the ds_config's ``bf16`` / ``fp16`` sections (fp32 otherwise)."""
    if (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled", False):
        return torch.bfloat16
    if (ds_config.get("fp16") or {}).get("enabled", False):
        return torch.float16
    return torch.float32


def load_model(spec: str, *, seq_len: int, dtype: torch.dtype, seed: int) -> LoadedModel:
    """Build the model named by ``--model`` with ``attn_implementation="wallfacer"`` (the caller imports
    ``ds_wallfacer.integration`` first, which registers it), refusing what cannot train: a tokenizer larger than
    the model's vocabulary, ``seq_len`` beyond ``max_position_embeddings``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    kind, path = resolve_model_source(spec)
    if kind == "preset":
        values = copy.deepcopy(PRESETS[spec])
        cfg = AutoConfig.for_model(values.pop("model_type"), **values)
        model_dir = None
    else:
        assert path is not None
        cfg = AutoConfig.from_pretrained(str(path))
        model_dir = path if kind == "pretrained" else path.parent
    text_cfg = text_config(cfg)
    limit = getattr(text_cfg, "max_position_embeddings", None)
    if limit is not None and seq_len > int(limit):
        raise StartupError(f"--seq_len {seq_len} is larger than the model's position limit max_position_embeddings = "
                           f"{limit}: lower --seq_len, or raise max_position_embeddings in the config (with a RoPE "
                           "scaling that supports it)")
    tokenizer, tok_id = _load_tokenizer(model_dir)
    vocab = int(text_cfg.vocab_size)
    if len(tokenizer) > vocab:
        raise StartupError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}: give "
                           "a model whose embedding covers the tokenizer (or a directory with a matching tokenizer)")
    eos = tokenizer.eos_token_id
    eos_id = int(eos) if eos is not None else BYTE_EOS_ID

    torch.manual_seed(seed)  # identical random weights on every rank
    # a vision-language model: its tower on sdpa, its text model's attention set by the integration (adapters/)
    vision = getattr(cfg, "vision_config", None) is not None
    auto, attn = (AutoModelForImageTextToText, "sdpa") if vision else (AutoModelForCausalLM, "wallfacer")
    if kind == "pretrained":
        model = auto.from_pretrained(str(model_dir), attn_implementation=attn, dtype=dtype)
        source = f"pretrained:{model_dir}"
    else:
        model = auto.from_config(cfg, attn_implementation=attn, dtype=dtype)
        source = f"config:{path}" if kind == "config" else f"preset:{spec}"
    return LoadedModel(model=model.train(), tokenizer=tokenizer, eos_id=eos_id, source=source, tokenizer_id=tok_id,
                       folder=model_dir)
