"""The placeholder pattern on shards: one adapter for every vision-language model whose forward merges images
by placeholder tokens (``placeholder_forms.py`` recognises it: LLaVA and its descendants, InternVL, Idefics,
SmolVLM, Mistral 3, Llama 4, ...).

The language model is sharded like any text model and keeps the text's 1-D positions (``positions`` answers None:
the loader's own positions, per document). What the images add:

* **which feature row each placeholder takes** (``media_index``, loader side): the k-th image (video) token of the
  batch takes row k of the batch's image (video) features, as ``masked_scatter`` gives it in the model's forward;
* **encoding** (``inputs``, loss side): the group splits the tower's work by its natural unit (an image, a tile, a
  video: ``media_units.units``) into runs of consecutive units, one per rank, each encoded in one call of the
  model's own features method; one all-gather (backward: a reduce-scatter) hands every rank the rows. A batch that
  does not cut into units, a tower that could not be tried on one unit (``probe_unit``) and a batch of one unit run
  the method whole on every rank instead (each rank's tower then gets the gradient of its own rows, and DeepSpeed
  sums the ranks);
* **embeddings**: each rank embeds its own tokens and puts its placeholders' rows in place.

Every rank calls every features method once per forward (a rank without units, or a batch without that kind of
media, on one probed unit whose output enters times 0), so ZeRO-3's gathers and ZeRO 1/2's gradient hooks run
alike on every rank and replica. One small all-gather per forward checks that the group's placeholders and feature
rows agree in number (the model's own check, over the group).

Design: Note [One adapter for the placeholder pattern] in docs/design/documents.md.
"""
from __future__ import annotations

import inspect
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..hf_config import text_config
from .media_tokens import GatherRows, media_index, token_types
from .media_units import Unit, contiguous_split, feature_rows, probe_unit, unit_slice, units
from .placeholder_forms import MediaKind, PlaceholderForm

__all__ = ["PlaceholderVisionLanguage"]

_KIND_TYPE = {"image": 1, "video": 2}


class PlaceholderVisionLanguage:
    """A ``VisionAdapter`` for a model with the placeholder pattern (``PlaceholderForm``)."""

    refusal: str | None = None

    def __init__(self, model: nn.Module, form: PlaceholderForm) -> None:
        self._model = model
        self._form = form
        self.kinds: dict[str, MediaKind] = {k.name: k for k in form.kinds}
        self.type_spans = form.type_spans
        """How the batch's ``token_type_ids`` become bidirectional spans (the loader asks); None: it has none."""
        self._units: dict[str, Unit | None] | None = None
        self.hidden = int(text_config(model).hidden_size)  # not the embedding's weight: ZeRO-3 would gather it

    @property
    def merger(self) -> nn.Module:
        """The module whose forward merges (the model, or its inner ``model``)."""
        return self._model.get_submodule(self._form.merger) if self._form.merger else self._model

    def _params(self, kind: str) -> list[str]:
        fn = getattr(self.merger, self.kinds[kind].method)
        return [p for p, v in inspect.signature(fn).parameters.items()
                if v.kind not in (v.VAR_KEYWORD, v.VAR_POSITIONAL)]

    def _config_args(self, kind: str, given: Mapping[str, Any]) -> dict[str, Any]:
        """The method's other arguments the config holds (``vision_feature_layer``, ...): what the forward passes."""
        cfg = self.merger.config
        return {p: getattr(cfg, p) for p in self._params(kind)[1:]
                if p not in given and getattr(cfg, p, None) is not None}

    # ---- loader side ----

    def token_types(self, ids: torch.Tensor, given: Any = None) -> torch.Tensor:
        image, video = self.kinds.get("image"), self.kinds.get("video")
        return token_types(ids, image.token_id if image else None, video.token_id if video else None, given)

    def positions(self, ids: torch.Tensor, types: torch.Tensor, media: Mapping[str, Any],
                  documents: Any) -> None:
        """None: the model numbers image tokens like text (the loader's positions, per document)."""
        return None

    media_index = staticmethod(media_index)

    def _arguments(self, media: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
        """{kind: its features method's arguments from the batch} for the kinds the batch holds."""
        out, used = {}, set()
        for kind in self.kinds:
            params = self._params(kind)
            if media.get(params[0]) is not None:
                out[kind] = {p: media[p] for p in params if media.get(p) is not None}
                used |= set(out[kind])
        unknown = sorted(k for k, v in media.items() if v is not None and k not in used)
        if unknown:
            raise ValueError(f"{type(self._model).__name__} takes no batch keys {unknown} with its images or videos "
                             f"(its features methods take {sorted({p for k in self.kinds for p in self._params(k)})})")
        return out

    # ---- loss side ----

    def inputs(self, input_ids: torch.Tensor, media_index: torch.Tensor | None, media: Mapping[str, Any], *,
               group: Any = None, comm: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
        """(inputs_embeds [B, S_l, H], keywords) of this rank's tokens, its placeholders' feature rows in place.
        Keywords: ``is_causal=True`` where the model builds its masks from token types (``type_spans``): they were
        measured causal plus spans on every layer, whatever its attention layers' ``is_causal`` says (PaliGemma's
        say False, their masks do the work)."""
        emb = self._model.get_input_embeddings()(input_ids)
        args = self._arguments(media)
        self._probe(emb.device, emb.dtype, lazily=True)
        p = dist.get_world_size(group) if group is not None and comm is not None else 1
        me = dist.get_rank(group) if p > 1 else 0
        local, touched, split = {}, emb.new_zeros(()), {}
        for kind in self.kinds:
            if kind in args:
                local[kind], split[kind] = self._encode(kind, args[kind], p, me, emb)
            else:
                touched = touched + self._touch(kind, emb)
        emb = emb + 0.0 * touched
        extra = {"is_causal": True} if self.type_spans is not None else {}
        if not local:
            return emb, extra
        placeholders = {k: input_ids == self.kinds[k].token_id for k in local}
        rows = self._exchange(local, split, placeholders, group=group, comm=comm, p=p)
        for kind, mask in placeholders.items():
            at = media_index[mask].to(emb.device)
            emb = emb.masked_scatter(mask[..., None], rows[kind].index_select(0, at).to(emb.dtype))
        return emb, extra

    def _run(self, kind: str, args: Mapping[str, Any], emb: torch.Tensor) -> torch.Tensor:
        """[rows, H]: the model's features method on ``args`` (moved to the embeddings' device)."""
        moved = {k: v.to(emb.device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
        out = getattr(self.merger, self.kinds[kind].method)(**moved, **self._config_args(kind, moved),
                                                            return_dict=True)
        return feature_rows(out, self.hidden, self._form.field)

    def _encode(self, kind: str, args: dict[str, Any], p: int, me: int,
                emb: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(this rank's feature rows of ``kind``, whether the group split the units): its run of units, or all
        of them when the batch does not split (one unit, no probed unit, one rank)."""
        pixel = self._params(kind)[0]
        probed = (self._units or {}).get(kind)
        u = units(args, pixel) if p > 1 and probed is not None and probed.independent else None
        if u is None or u.count < 2:
            return self._run(kind, args, emb), False
        start, end = contiguous_split(u.work, p)[me]
        if end > start:
            return self._run(kind, unit_slice(args, u, pixel, start, end), emb), True
        return emb.new_zeros(0, self.hidden) + self._touch(kind, emb), True

    def _touch(self, kind: str, emb: torch.Tensor) -> torch.Tensor:
        """0 x the features of the probed unit (a zero gradient to the tower, the same calls on every rank); 0
        when no unit could be probed."""
        unit = (self._units or {}).get(kind)
        if unit is None:
            return emb.new_zeros(())
        args = {k: v.to(dtype=emb.dtype) if v.is_floating_point() else v for k, v in unit.args.items()}
        return 0.0 * self._run(kind, args, emb).sum()

    def _exchange(self, local: dict[str, torch.Tensor], split: dict[str, bool], placeholders: dict[str, torch.Tensor],
                  *, group: Any, comm: Any, p: int) -> dict[str, torch.Tensor]:
        """{kind: every feature row of the batch} from each rank's rows: the split kinds' rows all-gathered (one
        call), after one small all-gather of each rank's row and placeholder counts that checks they agree."""
        kinds = list(local)
        counts = torch.tensor([local[k].shape[0] for k in kinds] + [int(placeholders[k].sum()) for k in kinds])
        if p == 1:
            table = counts[None]
        else:
            with comm.phase("vision"):
                table = comm.all_gather(comm.place(counts), group, kind="check").cpu()
        for i, k in enumerate(kinds):
            rows = int(table[:, i].sum()) if split[k] else int(table[0, i])
            tokens = int(table[:, len(kinds) + i].sum())
            if rows != tokens:
                raise ValueError(f"{type(self._model).__name__}: the batch has {tokens} {k} placeholder tokens "
                                 f"(id {self.kinds[k].token_id}) but its {k}s give {rows} feature rows")
        if not any(split.values()):
            return local
        mine = torch.cat([local[k] for k in kinds if split[k]])
        per_rank = table[:, [i for i, k in enumerate(kinds) if split[k]]]  # [P, split kinds]
        m = int(per_rank.sum(1).max())
        with comm.phase("vision"):
            padded = torch.cat([mine, mine.new_zeros(m - mine.shape[0], mine.shape[1])])
            every = GatherRows.apply(padded, comm, group)  # [P, m, H]
        out = dict(local)
        for j, k in enumerate([k for k in kinds if split[k]]):
            at = per_rank[:, :j].sum(1).tolist()
            out[k] = torch.cat([every[r, at[r]:at[r] + int(per_rank[r, j])] for r in range(p)])
        return out

    # ---- one probed unit per kind: the self-check's sample, the blank unit ----

    def _probe(self, device: torch.device, dtype: torch.dtype, *, lazily: bool = False) -> None:
        """Find one unit per kind (``probe_unit``), once. Lazily (at the first forward) only when no parameter is
        partitioned by ZeRO-3 (the start-up self-check probes inside its gathered parameters)."""
        if self._units is not None:
            return
        if lazily and any(hasattr(q, "ds_id") and q.numel() == 0 for q in self.merger.parameters()):
            return
        self._units = {kind: probe_unit(self.merger, kind, k.method, hidden=self.hidden, field=self._form.field,
                                        extra=self._config_args(kind, {}), device=device, dtype=dtype)
                       for kind, k in self.kinds.items()}

    def probed(self) -> dict[str, Unit | None]:
        """{kind: the unit its tower accepted (``probe_unit``), or None}: probed now if not yet."""
        q = next(self._model.parameters())
        self._probe(q.device, q.dtype)
        return dict(self._units or {})

    def sample(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """A one-row batch around ``ids`` [1, N] with two units of each kind (the second's pixels negated), spread
        over the row, where they fit: the start-up self-check's sequence."""
        found = self.probed()
        ids = ids.clone()
        for k in self.kinds.values():
            ids[ids == k.token_id] = 0
        pieces = [(kind, unit, sign) for kind, unit in found.items() if unit is not None
                  for sign in (1.0, -1.0)]
        n = ids.shape[1]
        while pieces and sum(u.rows + 1 for _, u, _ in pieces) + 1 > n:
            pieces = pieces[:-1]
        if not pieces:
            return {"input_ids": ids, **self._types(ids)}
        gap, at = (n - sum(u.rows for _, u, _ in pieces)) // (len(pieces) + 1), 0
        media: dict[str, list[dict[str, torch.Tensor]]] = {}
        for kind, unit, sign in pieces:
            at += gap
            ids[0, at:at + unit.rows] = self.kinds[kind].token_id
            at += unit.rows
            media.setdefault(kind, []).append({k: v * sign if k == unit.pixel else v for k, v in unit.args.items()})
        out = {"input_ids": ids, **self._types(ids)}
        for kind, many in media.items():
            out.update(found[kind].join(many))
        return out

    def _types(self, ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """The self-check's ``token_type_ids`` where the model builds spans from them: Gemma 3's at its image
        tokens, PaliGemma's prefix over the row's first half (within a window that sees it whole)."""
        ts = self.type_spans
        if ts is None:
            return {}
        if ts.single:
            n = ids.shape[1]
            on = torch.arange(n)[None] < min(n // 2, ts.whole_window or n)
        else:
            on = sum((ids == k.token_id for k in self.kinds.values()), torch.zeros_like(ids, dtype=torch.bool))
        return {ts.key: torch.where(on, ts.value, 1 - ts.value).long()}
