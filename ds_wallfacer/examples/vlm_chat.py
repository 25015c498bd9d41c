"""The image-conversation example: a few tiny PNG images, a JSONL of conversations about them, a tiny LLaVA and its
processor, all built here without downloading anything.

``vlm_chat/`` (shipped with the package) holds the images and ``chat.jsonl``, one conversation per line in TRL's
conversational form with images: ``{"messages": [...], "images": ["images/red_square.png"]}``, the image paths
relative to the file; the images go before the first user message's text, as TRL puts them. ``python -m
ds_wallfacer.examples.vlm_chat [FOLDER]`` writes them again; ``python -m ds_wallfacer.examples.vlm_chat --model
DIR`` saves the tiny LLaVA with its processor as a model folder (what ``python -m ds_wallfacer.train --model`` and
``AutoProcessor.from_pretrained`` read).

The model is ``LlavaForConditionalGeneration`` (the placeholder pattern, ``adapters/placeholder_vision.py``): a
2-layer Llama of width 64 and a 2-layer CLIP tower on 28 x 28 images of 14-pixel patches, so each image is 4
``<|image_pad|>`` tokens. The processor is the family's own class (``LlavaProcessor``) assembled from a word-level
tokenizer over the example's small vocabulary (its image and vision start / end tokens on the ids of
``vlm.tiny_vlm``'s placeholders, every id below the model's vocabulary of 128), the family's image processor (PIL
backend) with default settings but for the tower's 28-pixel side, and a chat template whose ``{% generation %}``
blocks mark the assistant turns (what ``assistant_only_loss`` needs). Qwen-VL's processors need torchvision (their
video processor), which the package does not require.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

from .vlm import END, IMAGE, START

__all__ = ["CHAT_TEMPLATE", "VLM_CHAT_DIR", "chat_processor", "load_image_chats", "make_image_chats",
           "save_vlm_folder", "tiny_llava", "write_example"]

VLM_CHAT_DIR = Path(__file__).resolve().parent / "vlm_chat"
"""The shipped example: ``images/*.png`` and ``chat.jsonl``."""
SIDE = 28
"""Pixels per image side the tiny tower takes (2 x 2 patches of 14)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{% set blocks = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set blocks = message['content'] %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% for b in blocks %}{% if b['type'] == 'text' %}{{ b['text'] }}{% endif %}{% endfor %}<|im_end|>"
    "{% endgeneration %}\n"
    "{% else %}{% for b in blocks %}"
    "{% if b['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif b['type'] == 'text' %}{{ b['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Each image ``<|vision_start|><|image_pad|><|vision_end|>`` (the processor repeats the pad once per image
feature); an assistant turn and its ``<|im_end|>`` are the generation, so the loss covers the reply and its
stop."""

_SPECIAL = {"<pad>": 0, "<|im_end|>": 1, "<unk>": 2, "<|im_start|>": 3,
            "<|image_pad|>": IMAGE, "<|vision_start|>": START, "<|vision_end|>": END}
_COLORS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
_SHAPES = ("square", "stripe", "dot")
_SIZES = {"square": (56, 56), "stripe": (28, 84), "dot": (28, 28)}
"""Pixels (height, width) of each shape's image as stored (the image processor resizes and crops them to the
tower's ``SIDE``)."""
_WORDS = ("system", "user", "assistant", "you", "describe", "images", "briefly", "what", "color", "is", "the",
          "shape", "which", "how", "many", "are", "there", "first", "second", "and", "a", "an", "image", "one",
          "two", "both", "same", "different", "it", "of", "in", "picture", "this", "?", ".", ",",
          *_COLORS, *_SHAPES)


def _tokenizer() -> Any:
    """A word-level tokenizer over ``_WORDS`` (lower-cased words and punctuation; anything else is ``<unk>``), the
    special tokens on their fixed ids; ``<|im_end|>`` is EOS, ``<pad>`` padding."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    free = [i for i in range(128) if i not in _SPECIAL.values()]
    vocab = {**_SPECIAL, **{w: free[k] for k, w in enumerate(_WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
                                   model_max_length=1 << 20)
    fast.add_special_tokens({"additional_special_tokens": [t for t in _SPECIAL if t not in ("<pad>", "<unk>")]})
    return fast


def chat_processor() -> Any:
    """The tiny LLaVA's ``LlavaProcessor``: the word-level tokenizer, LLaVA's image processor (PIL backend: shortest
    side resized to ``SIDE``, centre crop ``SIDE`` x ``SIDE``), ``CHAT_TEMPLATE``; 4 image tokens per image (the
    CLIP tower's patches without its class token)."""
    from transformers import LlavaProcessor
    from transformers.models.llava.image_processing_pil_llava import LlavaImageProcessorPil

    images = LlavaImageProcessorPil(size={"shortest_edge": SIDE}, crop_size={"height": SIDE, "width": SIDE})
    return LlavaProcessor(image_processor=images, tokenizer=_tokenizer(), patch_size=14,
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token="<|image_pad|>", chat_template=CHAT_TEMPLATE)


def tiny_llava(*, seed: int = 0) -> Any:
    """The tiny ``LlavaForConditionalGeneration`` in fp32 (text: 2 Llama layers of 64, 4 query / 2 kv heads,
    vocabulary 128; vision: 2 CLIP layers of 32 on ``SIDE``-pixel images), no dropout, on sdpa."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=2, image_size=SIDE, patch_size=14)
    cfg = tf.LlavaConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, vision_feature_layer=-1,
                         vision_feature_select_strategy="default")
    model = tf.LlavaForConditionalGeneration(cfg).float().train()
    model.set_attn_implementation("sdpa")
    return model


def _image_name(color: str, shape: str) -> str:
    return f"images/{color}_{shape}.png"


def _turn(rng: random.Random, pictures: list[tuple[str, str]]) -> tuple[str, str]:
    """A question about the conversation's images and its answer."""
    if len(pictures) == 1:
        color, shape = pictures[0]
        if rng.random() < 0.5:
            return "What color is the shape ?", f"It is {color} ."
        return "Describe the image briefly .", f"A {color} {shape} ."
    (c1, s1), (c2, s2) = pictures
    if rng.random() < 0.5:
        return "What color is the second image ?", f"The second image is {c2} ."
    return "Are the images the same color ?", "Both are " + c1 + " ." if c1 == c2 else f"No , {c1} and {c2} ."


def make_image_chats(n: int = 24, *, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` conversations, each about one or (every third) two of the example's images, deterministic in
    ``seed``; every fourth starts with a system message."""
    rng = random.Random(seed)
    kinds = [(c, s) for c in _COLORS for s in _SHAPES]
    chats = []
    for i in range(n):
        pictures = [rng.choice(kinds) for _ in range(2 if i % 3 == 2 else 1)]
        question, answer = _turn(rng, pictures)
        messages = [{"role": "system", "content": "You describe images briefly ."}] if i % 4 == 0 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        chats.append({"messages": messages, "images": [_image_name(*p) for p in pictures]})
    return chats


def write_example(folder: str | Path = VLM_CHAT_DIR) -> Path:
    """The example's images (one PNG per color and shape, a few hundred bytes each) and ``chat.jsonl``."""
    from PIL import Image, ImageDraw

    folder = Path(folder)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    for color, rgb in _COLORS.items():
        for shape in _SHAPES:
            h, w = _SIZES[shape]
            img = Image.new("RGB", (w, h), (245, 245, 245))
            ImageDraw.Draw(img).rectangle([w // 7, h // 7, w - 1 - w // 7, h - 1 - h // 7], fill=rgb)
            img.save(folder / _image_name(color, shape), optimize=True)
    (folder / "chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in make_image_chats()), encoding="utf-8")
    return folder


def load_image_chats(path: str | Path = VLM_CHAT_DIR / "chat.jsonl") -> list[dict[str, Any]]:
    """The conversations of a JSONL file with their images opened (PIL, RGB), as TRL's ``SFTTrainer`` takes them
    (``{"messages", "images"}``); image paths are relative to the file's folder."""
    from PIL import Image

    root = Path(path).parent
    rows = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            row = json.loads(line)
            row["images"] = [Image.open(root / p).convert("RGB") for p in row.get("images", [])]
            rows.append(row)
    return rows


def save_vlm_folder(path: str | Path, *, seed: int = 0) -> Path:
    """``tiny_llava()`` and ``chat_processor()`` saved as a model folder."""
    path = Path(path)
    tiny_llava(seed=seed).save_pretrained(str(path))
    chat_processor().save_pretrained(str(path))
    return path


if __name__ == "__main__":  # write the example again, or (--model DIR) save the tiny model folder
    if sys.argv[1:2] == ["--model"]:
        print(save_vlm_folder(sys.argv[2]))
    else:
        print(write_example(sys.argv[1] if len(sys.argv) > 1 else VLM_CHAT_DIR))
