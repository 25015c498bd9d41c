"""Images and videos in a batch: the keys they arrive under, and what the loader, the loss module and the start-up
self-check ask of a vision-language model's adapter (``VisionAdapter``).

The adapters live in ``adapters/mrope_vision.py`` (``MropeVisionLanguage``, the M-RoPE families),
``adapters/vision.py`` (``RefusedVision`` for a model with a vision tower and no adapter) and
``adapters/placeholder_vision.py`` (the placeholder pattern); this module names the seam so that each consumer says
what it receives without importing them. Design: Note [Images in a sequence-parallel row] in docs/design/documents.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

import torch

if TYPE_CHECKING:
    import torch.distributed as dist

    from ..comm import CommLayer

__all__ = ["MEDIA_KEYS", "TOKEN_TYPES_KEY", "VisionAdapter"]

MEDIA_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
              "image_sizes", "pixel_attention_mask", "pixel_mask", "batch_num_images", "spatial_shapes",
              "high_res_pixel_values", "image_merge_sizes", "video_merge_sizes", "pixel_values_local",
              "num_local_patches", "patches_grid", "target_sizes", "target_sizes_videos", "video_second_per_grid")
"""Images and videos as the processors give them (Qwen-VL's grids, LLaVA-NeXT's and Pixtral's ``image_sizes``,
Idefics' ``pixel_attention_mask``, MiniCPM-V's ``target_sizes``, ...): passed to every rank of the group unsharded (with ``vision``); the
model's adapter takes the ones its features methods take."""
TOKEN_TYPES_KEY = "mm_token_type_ids"
"""The processor's per-token kinds (0 text, 1 image, 2 video); the loader checks them against the token ids."""


class VisionAdapter(Protocol):
    """A vision-language model's images and videos on shards. Loader side (pure functions of the full row):
    ``token_types``, ``positions``, ``media_index``; loss side (this rank's embeddings): ``inputs``; the self-check:
    ``sample``. Shapes: B rows of N tokens; S_l = N / P tokens on this rank."""

    refusal: str | None
    """Why this model's batches with images or videos are refused (its loader-side and loss-side methods raise it);
    None for an adapted model."""

    def token_types(self, ids: torch.Tensor, given: Any = None) -> torch.Tensor:
        """[B, N] int: 0 text, 1 image, 2 video; ``given``: the processor's ``TOKEN_TYPES_KEY``, checked."""
        ...

    def positions(self, ids: torch.Tensor, types: torch.Tensor, media: Mapping[str, Any],
                  documents: Sequence[Sequence[int]] | None) -> torch.Tensor | None:
        """[3, B, N] M-RoPE positions of the full row, each packed document (``documents``) on its own; None when
        the model numbers image tokens like text (the loader's positions)."""
        ...

    def media_index(self, types: torch.Tensor) -> torch.Tensor:
        """[B, N]: each image (video) token's row in the batch's features, -1 for text."""
        ...

    def inputs(self, input_ids: torch.Tensor, media_index: torch.Tensor | None, media: Mapping[str, Any], *,
               group: dist.ProcessGroup | None = None,
               comm: CommLayer | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """(inputs_embeds [B, S_l, H], extra language-model keywords) of this rank's tokens, the vision tower's work
        split over ``group``."""
        ...

    def sample(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The self-check's one-row batch around the random token ids [1, N] (with an image when adapted)."""
        ...
