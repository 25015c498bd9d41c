"""A batch's images (videos) as units of the tower's work, and one unit found by trying the tower.

A features method (``get_image_features``) takes its pixels in one of two layouts:

* **leading**: one unit per row of the pixel tensor (an image, a tile, a video), every other tensor argument with
  one row per unit too (``image_sizes``, ``pixel_attention_mask``);
* **grid**: patch rows, each unit's ``t x h x w`` rows described by one row of a ``*_grid_thw`` argument, every other
  tensor argument with one row per unit (``image_merge_sizes``).

A run of consecutive units is then a slice of every argument (``unit_slice``), and its feature rows are the rows
that run of units has in the whole batch's output, in order, when the tower treats every unit on its own (which the
start-up self-check checks with two units on two ranks). Any other argument (``batch_num_images``, lists) makes the
batch one piece: the tower runs whole on every rank (``units`` answers None).

``probe_unit`` builds one small unit from the config and the method's parameters and runs the tower on it once
(no gradient): the self-check's sample and the blank unit a rank without units runs are built from it.

Design: Note [One adapter for the placeholder pattern] in docs/design/documents.md.
"""
from __future__ import annotations

import dataclasses
import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

__all__ = ["Unit", "Units", "contiguous_split", "feature_rows", "pixel_row", "probe_unit", "unit_slice", "units"]


@dataclass(frozen=True)
class Units:
    """The units of one kind's media: their count, each one's work and how to cut a run of them."""

    count: int
    work: tuple[int, ...]
    """Pixel values per unit (what the tower's time follows)."""
    grid: str | None
    """The ``*_grid_thw`` argument of the grid layout; None: the leading layout."""


@dataclass(frozen=True)
class Unit:
    """One unit the tower accepts: its arguments (one unit each) and the feature rows it gives."""

    args: dict[str, torch.Tensor]
    rows: int
    pixel: str
    """The pixel argument."""
    packed: bool
    """Whether units join along the pixel tensor's last dimension (MiniCPM-V packs every image's patches in one row)
    rather than its first."""
    independent: bool
    """Whether two units (this one and its negated pixels) together give the rows each gives alone: the tower treats
    every unit on its own, so the group may split them."""

    def join(self, many: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The arguments of several units of this layout (each like ``args``) as one call's."""
        return {k: torch.cat([a[k] for a in many], dim=-1 if self.packed and k == self.pixel else 0)
                for k in many[0]}


def _grid_key(args: Mapping[str, Any]) -> str | None:
    keys = [k for k in args if k.endswith("grid_thw")]
    return keys[0] if len(keys) == 1 else None


def units(args: Mapping[str, Any], pixel: str) -> Units | None:
    """The units of ``args`` (the features method's arguments from the batch; ``pixel`` its pixel argument), or
    None when they do not cut into units (an argument not one row per unit)."""
    pix = args.get(pixel)
    if not isinstance(pix, torch.Tensor) or pix.dim() == 0:
        return None
    grid = _grid_key(args)
    if grid is not None:
        g = torch.as_tensor(args[grid]).reshape(-1, 3)
        sizes = g.prod(-1).tolist()
        if sum(sizes) != pix.shape[0]:
            return None
        n, work = g.shape[0], tuple(int(s) * int(pix[0].numel()) for s in sizes)
    else:
        n, work = pix.shape[0], tuple(int(pix[i].numel()) for i in range(pix.shape[0]))
    for key, value in args.items():
        if key in (pixel, grid):
            continue
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != n:
            return None
    return Units(count=n, work=work, grid=grid)


def unit_slice(args: Mapping[str, torch.Tensor], u: Units, pixel: str, start: int, end: int) -> dict[str, Any]:
    """The arguments of units ``start`` .. ``end - 1`` (every argument sliced; the grid layout's pixel rows by the
    grid)."""
    out = {k: v[start:end] for k, v in args.items()}
    if u.grid is not None:
        sizes = torch.as_tensor(args[u.grid]).reshape(-1, 3).prod(-1).tolist()
        out[pixel] = args[pixel][int(sum(sizes[:start])):int(sum(sizes[:end]))]
    return out


def contiguous_split(work: Sequence[int], ranks: int) -> list[tuple[int, int]]:
    """Each rank's run of consecutive units [start, end): the smallest largest run's work (binary search over it,
    each rank filled in turn up to it); pure, so every rank computes the same split. Runs in rank order keep the
    batch's order of feature rows; trailing ranks may get none."""
    work = [int(w) for w in work]

    def starts(limit: int) -> list[int] | None:
        out, load = [0], 0
        for i, w in enumerate(work):
            if load + w > limit and load > 0:
                out.append(i)
                load = 0
            load += w
        return out if len(out) <= ranks else None

    lo, hi = max(work, default=0), sum(work)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if starts(mid) is not None else (mid + 1, hi)
    cut = starts(lo) or [0]
    cut += [len(work)] * (ranks - len(cut))
    return [(s, cut[r + 1] if r + 1 < ranks else len(work)) for r, s in enumerate(cut)]


def feature_rows(out: Any, hidden: int, field: str = "pooler_output") -> torch.Tensor:
    """A features method's output -> [rows, hidden] in the order ``masked_scatter`` writes them: the ``field`` of
    the output (a tensor [units, tokens, hidden], or one tensor per unit) flattened row by row."""
    value = getattr(out, field, None) if not isinstance(out, (torch.Tensor, list, tuple)) else out
    if value is None:
        raise ValueError(f"the features method returned no {field}")
    parts = list(value) if isinstance(value, (list, tuple)) else [value]
    return torch.cat([p.reshape(-1, hidden) for p in parts], dim=0)


def pixel_row(vision_config: Any) -> int:
    """Values per patch row of ``pixel_values``: channels x temporal patch x patch side^2 (1,176 in Qwen2.5-VL)."""
    vc = vision_config
    channels = int(getattr(vc, "in_channels", getattr(vc, "in_chans", 3)))
    return channels * _temporal(vc) * int(vc.patch_size) ** 2


def _temporal(vc: Any) -> int:
    return int(getattr(vc, "temporal_patch_size", None) or getattr(vc, "patch_temporal", None) or 1)


def _merge(vc: Any) -> int:
    return _first_int(getattr(vc, "spatial_merge_size", None) or getattr(vc, "merge_kernel_size", None)
                      or getattr(vc, "merge_size", None), 1)


def _vision_config(config: Any) -> Any:
    for key in ("vision_config", "vision_tower_config", "visual_config"):
        vc = getattr(config, key, None)
        if vc is not None:
            return vc
    return config


def _first_int(value: Any, default: int) -> int:
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return int(value) if isinstance(value, (int, float)) and value else default


def _image_side(vc: Any) -> int:
    patch = _first_int(getattr(vc, "patch_size", None), 14)
    side = _first_int(getattr(vc, "image_size", None), 0)
    return side or 2 * patch * _first_int(getattr(vc, "spatial_merge_size", None), 2)


def _candidates(method: Callable, config: Any, kind: str, g: torch.Generator) -> list[dict[str, Any]]:
    """Arguments for one unit of ``kind``, in the layouts the tiny and the released models take, simplest first."""
    params = [p for p, v in inspect.signature(method).parameters.items() if v.kind not in (v.VAR_KEYWORD,
                                                                                           v.VAR_POSITIONAL)]
    if not params:
        return []
    pixel, vc = params[0], _vision_config(config)
    ch = int(getattr(vc, "num_channels", None) or getattr(vc, "in_channels", None) or 3)
    side = _image_side(vc)
    rand = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    frames = 2 if kind == "video" else 1
    out: list[dict[str, Any]] = []
    grid = next((p for p in params if p.endswith("grid_thw")), None)
    if grid is not None:
        merge = _merge(vc)
        t = _temporal(vc) if kind == "video" else 1
        patch = _first_int(getattr(vc, "patch_size", None), 14)
        extra = {p: torch.tensor([merge]) for p in params if p.endswith("merge_sizes")}
        for m in (merge, 2 * merge):
            cells, thw = t * m * m, torch.tensor([[t, m, m]])
            out.append({pixel: rand(cells, pixel_row(vc)), grid: thw, **extra})  # flattened patch rows (Qwen)
            out.append({pixel: rand(cells, ch, patch, patch), grid: thw, **extra})  # patch images (Kimi)
        return out
    image = (ch, side, side)
    patch = _first_int(getattr(vc, "patch_size", None), side)
    cells = (side // patch) ** 2
    others = {p: rand(1, *_side_image(config, p, ch)) for p in _required(method)[1:] if p.endswith("pixel_values")}
    sizes = {"image_sizes": torch.tensor([[side, side]])} if "image_sizes" in params else {}
    if kind == "video":
        out.append({pixel: rand(1, frames, *image)})
    out.append({pixel: rand(1, *image), **others})
    if "spatial_shapes" in params:  # patch rows of a variable-size image (SigLIP-2 naflex)
        n = side // patch
        out.append({pixel: rand(1, n * n, ch * patch * patch), "spatial_shapes": torch.tensor([[n, n]]),
                    "pixel_attention_mask": torch.ones(1, n * n, dtype=torch.bool)})
    out.append({pixel: rand(1, cells, ch * patch * patch)})  # patch rows (Fuyu)
    sizes_key = next((p for p in params[1:] if p.startswith("target_sizes")), None)
    if sizes_key is not None:  # patches packed along one row, each image's [h, w] in patches (MiniCPM-V)
        n = side // patch
        out.append({pixel: rand(1, ch, patch, n * n * patch), sizes_key: torch.tensor([[n, n]])})
    if sizes:
        out.append({pixel: rand(1, *image), **sizes})
    tiles = _tiles(method, config, side)
    if tiles:
        out.append({pixel: rand(1, tiles, *image), **sizes})
    five = {pixel: rand(1, 1, *image)}
    if "pixel_attention_mask" in params:
        five["pixel_attention_mask"] = torch.ones(1, 1, side, side, dtype=torch.bool)
    out.append(five)
    if "pixel_mask" in params:
        out.append({pixel: rand(1, *image), "pixel_mask": torch.ones(1, side, side, dtype=torch.bool)})
    return out


def _required(method: Callable) -> list[str]:
    return [p for p, v in inspect.signature(method).parameters.items()
            if v.default is v.empty and v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]


def _side_image(config: Any, param: str, channels: int) -> tuple[int, int, int]:
    """A second image argument (``high_res_pixel_values``) at its own tower's size (``high_res_vision_config``)."""
    vc = getattr(config, param[: -len("pixel_values")].strip("_") + "_vision_config", None)
    side = _image_side(vc) if vc is not None else 0
    return channels, side, side


def _tiles(method: Callable, config: Any, side: int) -> int:
    """Tiles per image of a LLaVA-NeXT-like tower (its module's ``image_size_to_num_patches``), 0 if none."""
    fn = getattr(sys.modules.get(getattr(inspect.unwrap(method), "__module__", ""), None), "image_size_to_num_patches",
                 None)
    pinpoints = getattr(config, "image_grid_pinpoints", None)
    if fn is None or not pinpoints:
        return 0
    try:
        return int(fn(image_size=(side, side), grid_pinpoints=pinpoints, patch_size=side))
    except Exception:  # noqa: BLE001 - a layout this release computes otherwise: the next candidate
        return 0


def probe_unit(merger: nn.Module, kind: str, method: str, *, hidden: int, field: str = "pooler_output",
               extra: Mapping[str, Any] | None = None, device: torch.device | None = None,
               dtype: torch.dtype | None = None) -> Unit | None:
    """One unit of ``kind`` the merging module's ``method`` accepts (random pixels, seeded), with its feature rows;
    None when no candidate layout runs. ``extra``: the config's values of the method's other arguments. Runs the
    tower without gradients, random state kept."""
    fn = getattr(merger, method)
    g = torch.Generator().manual_seed(0x1A6E)

    def run(args: Mapping[str, torch.Tensor]) -> torch.Tensor:
        moved = {k: v.to(device=device, dtype=dtype if v.is_floating_point() and dtype is not None else v.dtype)
                 for k, v in args.items()}
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            return feature_rows(fn(**moved, **(extra or {}), return_dict=True), hidden, field).float()

    pixel = next(iter(inspect.signature(fn).parameters))
    for args in _candidates(fn, merger.config, kind, g):
        try:
            rows = run(args)
        except Exception:  # noqa: BLE001 - the tower rejects this layout: try the next
            continue
        if rows.shape[0] > 0 and bool(torch.isfinite(rows).all()):
            packed = args[pixel].shape[0] == 1 and any(k.startswith("target_sizes") for k in args)
            unit = Unit(args={k: v.cpu() for k, v in args.items()}, rows=int(rows.shape[0]), pixel=pixel,
                        packed=packed, independent=False)
            return dataclasses.replace(unit, independent=_independent(run, unit, rows, dtype))
    return None


def _independent(run: Callable, unit: Unit, rows: torch.Tensor, dtype: torch.dtype | None) -> bool:
    """Whether the tower gives two units together the rows it gives each alone (relative 1e-4 in fp32, 1e-2 in
    half precision, of the largest value)."""
    other = {k: -v if v.is_floating_point() else v for k, v in unit.args.items()}
    try:
        pair = run(unit.join([unit.args, other]))
        alone = torch.cat([rows, run(other)])
    except Exception:  # noqa: BLE001 - two units at once are not accepted: the batch runs whole
        return False
    tol = (1e-4 if dtype in (None, torch.float32, torch.float64) else 1e-2) * float(alone.abs().max()) + 1e-6
    return pair.shape == alone.shape and float((pair - alone).abs().max()) <= tol
