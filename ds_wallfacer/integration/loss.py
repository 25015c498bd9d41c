"""The global token-mean causal-LM loss across sequence-parallel ranks.

Each rank computes (loss_sum, token_count) over its shard's non-ignored ``shift_labels``; both are summed over
the sequence-parallel group and divided: the same number a non-parallel run prints, on every rank. The local loss
is pluggable (``LocalLoss``): full logits from the model, or the Mini-Sequence LM head
(``ds_wallfacer.mst.mini_sequence_causal_lm_loss``). The MoE router's aux loss (``moe.py``) travels in the same
all-gather; length-reading rotary embeddings (``rope.py``) are shown the global length during the forward.

Design: docs/design/layouts.md, Note [Gradient normalisation across ZeRO stages] (why every ZeRO stage is exact).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..comm import CommLayer
from ..data.media import MEDIA_KEYS, VisionAdapter
from ..hf_config import backbone
from ..adapters.mixer_shards import MixerInputs
from ..adapters.moe import RouterAuxLoss
from ..adapters.positional import POSITIONS_KWARG
from ..adapters.rope import RopeLength
from ..mst.config import MiniSequenceConfig
from ..mst.lm_head import head_transform
from .dynamic import DynamicGroups, GroupOfSize
from .packing import BATCH_KWARG, PackedBatches

__all__ = ["LocalLoss", "SequenceParallelCausalLM", "global_token_mean", "lm_logits", "local_loss_for",
           "logits_loss", "mini_sequence_loss"]

LocalLoss = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""``fn(lm, *, input_ids, position_ids, shift_labels, ignore_index, **model_kwargs) -> (loss_sum fp32, token_count)``;
``model_kwargs`` (only for packed or balanced batches) go to the model's forward, which hands them to attention."""


class _SumOverRanks(torch.autograd.Function):
    """[k] on each rank -> [k] summed over ``group``, in rank order (bitwise equal on every rank); backward: the
    gradients summed likewise (the adjoint of a replicated sum)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: CommLayer, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        with comm.phase("loss"):
            return comm.all_gather(x, group).sum(0)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        with ctx.comm.phase("loss"):
            return ctx.comm.all_gather(g.contiguous(), ctx.group).sum(0), None, None


def global_token_mean(
    loss_sum: torch.Tensor, count: torch.Tensor, *, group: dist.ProcessGroup, comm: CommLayer
) -> torch.Tensor:
    """Sum of token losses over the group / number of non-ignored tokens over the group (0 when there are none)."""
    # one fp64 all-gather for both: token counts stay exact far beyond fp32's 2^24
    both = torch.stack([loss_sum.double(), count.detach().to(device=loss_sum.device, dtype=torch.float64)])
    total = _SumOverRanks.apply(both, comm, group)
    return (total[0] / total[1].clamp(min=1)).float()


def lm_logits(lm: nn.Module, *, input_ids: torch.Tensor, position_ids: torch.Tensor,
              **model_kwargs: Any) -> torch.Tensor:
    """The model's logits [B, S_l, V] of this rank's tokens. A vision-language row (``inputs_embeds`` in
    ``model_kwargs``, ``input_ids`` None) runs the language model and the LM head directly."""
    if "inputs_embeds" in model_kwargs:  # what the model does after its head too (Cohere's logit_scale, soft-caps)
        return head_transform(lm)(lm.get_output_embeddings()(_decoder_hidden(lm, position_ids, model_kwargs)))
    return lm(input_ids=input_ids, position_ids=position_ids, use_cache=False, **model_kwargs).logits


def logits_loss(
    lm: nn.Module, *, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
    ignore_index: int = -100, **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) from the model's own logits (fp32 cross-entropy, like HF's loss)."""
    logits = lm_logits(lm, input_ids=input_ids, position_ids=position_ids, **model_kwargs)
    labels = shift_labels.reshape(-1).to(logits.device)
    loss_sum = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels, ignore_index=ignore_index, reduction="sum"
    )
    return loss_sum, (labels != ignore_index).sum()


def mini_sequence_loss(
    lm: nn.Module, *, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor,
    ignore_index: int = -100, **model_kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss_sum, count) with the Mini-Sequence LM head: the backbone's hidden states, then chunked head + CE."""
    from ..mst import mini_sequence_causal_lm_loss

    if "inputs_embeds" not in model_kwargs:
        model_kwargs = {"input_ids": input_ids, **model_kwargs}
    hidden = _decoder_hidden(lm, position_ids, model_kwargs)
    return mini_sequence_causal_lm_loss(lm, hidden, shift_labels.to(hidden.device), ignore_index=ignore_index)


def local_loss_for(mini_sequence: MiniSequenceConfig | None, *, given: LocalLoss | None = None) -> LocalLoss:
    """``given`` (the caller's), else the Mini-Sequence LM head when ``mini_sequence.lm_head`` is on, else the
    model's logits."""
    if given is not None:
        return given
    return mini_sequence_loss if (mini_sequence is not None and mini_sequence.lm_head) else logits_loss


def _decoder_hidden(lm: nn.Module, position_ids: torch.Tensor, model_kwargs: dict[str, Any]) -> torch.Tensor:
    """The backbone's last hidden states [B, S_l, H] (``hf_config.backbone``)."""
    out = backbone(lm)(position_ids=position_ids, use_cache=False, **model_kwargs)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


class SequenceParallelCausalLM(nn.Module):
    """What ``deepspeed.initialize`` receives: the HF causal LM (``.lm``, unchanged) and the global token-mean
    loss. ``forward(input_ids, position_ids, shift_labels)`` takes a batch from the sequence-parallel loader
    (plus ``token_mask`` / ``sequence_length`` when the loader padded) and returns one scalar.

    ``router_aux``: the model's router aux loss (``moe.py``), added as ``coef * aux``; the last value (detached,
    before ``coef``) is ``last_aux_loss`` for logging. ``rope``: the global length for rotary embeddings that read
    it (``rope.py``); ``sp_size``: P, for that length when the loader did not pad."""

    def __init__(
        self,
        lm: nn.Module,
        *,
        group: dist.ProcessGroup,
        comm: CommLayer,
        local_loss: LocalLoss = logits_loss,
        ignore_index: int = -100,
        router_aux: RouterAuxLoss | None = None,
        rope: RopeLength | None = None,
        sp_size: int = 1,
        packing: PackedBatches | None = None,
        positions: bool = False,
        mixer_inputs: MixerInputs | None = None,
        dynamic: DynamicGroups | None = None,
        vision: VisionAdapter | None = None,
    ) -> None:
        super().__init__()
        self.vision = vision
        """The model's vision-language adapter (``adapters/vision.py``); None for a text model."""
        self._packing = packing
        self._positions = positions
        """Whether attention layers need the tokens' positions (``positional.POSITIONS_KWARG``)."""
        self._mixer_inputs = mixer_inputs
        """Where the mixer layers read this forward's batch structure (``mixer_layers.py``); None: the model has
        none."""
        self.lm = lm
        self._group, self._comm, self._local_loss, self.ignore_index = group, comm, local_loss, ignore_index
        self.router_aux, self._rope, self._sp_size = router_aux, rope, sp_size
        self.last_aux_loss: torch.Tensor | None = None
        self._captured: list[torch.Tensor] | None = None
        self.dynamic = dynamic
        """``integration.dynamic.DynamicGroups`` with dynamic sequence parallelism, else None."""
        if dynamic is not None:
            dynamic.on_switch = self._use_group
        if router_aux is not None:
            # the decoder's output carries router_logits (output_router_logits is on), whichever local loss runs it
            lm.get_decoder().register_forward_hook(self._capture_router_logits)

    @property
    def rope(self) -> RopeLength | None:
        """The global length shown to rotary embeddings that read it; None when the model has none."""
        return self._rope

    def attention_kwargs(self, position_ids: torch.Tensor, document_starts: torch.Tensor | None = None,
                         chunk_assignment: torch.Tensor | None = None,
                         bidirectional_spans: torch.Tensor | None = None) -> dict[str, Any]:
        """The model-forward keywords attention needs beyond the tensors: a packed batch's documents and its rows'
        bidirectional spans (checked across the group) and, for layers that scale by position, the tokens' positions.
        The mixer layers get the same through ``MixerInputs`` (models need not pass keywords down to them)."""
        kwargs: dict[str, Any] = {}
        if document_starts is not None or chunk_assignment is not None or bidirectional_spans is not None:
            if self._packing is None:
                raise ValueError("this batch packs documents (document_starts / chunk_assignment / "
                                 "bidirectional_spans), but the model was not built by "
                                 "ds_wallfacer.integration.initialize, which sets up packed batches")
            kwargs[BATCH_KWARG] = self._packing.batch(position_ids, document_starts, chunk_assignment,
                                                      bidirectional_spans)
            if self._rope is not None and document_starts is not None:
                raise ValueError(
                    "packed documents with a RoPE type that reads the sequence length (dynamic / longrope): each "
                    "document would need its own scaling; train without packing or with a fixed RoPE type"
                )
        if self._positions:
            kwargs[POSITIONS_KWARG] = position_ids
        if self._mixer_inputs is not None:
            self._mixer_inputs.batch, self._mixer_inputs.positions = kwargs.get(BATCH_KWARG), position_ids
        return kwargs

    def _use_group(self, g: GroupOfSize) -> None:
        """Dynamic sequence parallelism: this forward's group of ``g.size`` ranks (``DynamicGroups.use``)."""
        self._group, self._packing, self._sp_size = g.groups.sp_group, g.packing, g.size
        if self._mixer_inputs is not None and g.mixing is not None:
            self._mixer_inputs = g.mixing.inputs

    def _capture_router_logits(self, module: nn.Module, args: Any, out: Any) -> None:
        if self._captured is not None:
            logits = getattr(out, "router_logits", None)
            if logits:
                self._captured.extend(logits)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        shift_labels: torch.Tensor,
        token_mask: torch.Tensor | None = None,
        sequence_length: torch.Tensor | None = None,
        document_starts: torch.Tensor | None = None,
        chunk_assignment: torch.Tensor | None = None,
        bidirectional_spans: torch.Tensor | None = None,
        sequence_parallel_size: torch.Tensor | None = None,
        loss_weight: torch.Tensor | None = None,
        mrope_position_ids: torch.Tensor | None = None,
        media_index: torch.Tensor | None = None,
        **media: torch.Tensor,
    ) -> torch.Tensor:
        """``sequence_parallel_size`` and ``loss_weight`` (dynamic sequence parallelism's loader): the row's group
        size, and the factor that turns the group's summed token losses into this forward's share of the step's
        token mean (``data/dynamic.py``). ``mrope_position_ids``, ``media_index`` and the images / videos
        (``MEDIA_KEYS``): a vision-language batch (``adapters/vision.py``); the local loss then gets
        ``input_ids=None`` and ``inputs_embeds``."""
        if (sequence_parallel_size is None) != (loss_weight is None):
            raise ValueError("a dynamic batch carries both sequence_parallel_size and loss_weight")
        if sequence_parallel_size is not None:
            if self.dynamic is None:
                raise ValueError("this batch is from a dynamic sequence-parallel loader, but the run was built without "
                                 'wallfacer.dynamic_sequence_parallel: add the key, or use sp.dataloader\'s batches')
            self.dynamic.use(int(sequence_parallel_size.reshape(-1)[0]))
        elif self.dynamic is not None:  # a batch sharded over all P ranks (sp.shard, an evaluation)
            self.dynamic.use(self.dynamic.sp_size)
        ids, rope_positions, model_kwargs = self.model_inputs(
            input_ids, position_ids, document_starts=document_starts, chunk_assignment=chunk_assignment,
            bidirectional_spans=bidirectional_spans, mrope_position_ids=mrope_position_ids, media_index=media_index,
            **media)
        length = int(sequence_length.max()) if sequence_length is not None else position_ids.shape[-1] * self._sp_size
        rope = self._rope.use(length) if self._rope is not None else contextlib.nullcontext()
        self._captured = [] if self.router_aux is not None else None
        try:
            with rope:
                loss_sum, count = self._local_loss(
                    self.lm, input_ids=ids, position_ids=rope_positions, shift_labels=shift_labels,
                    ignore_index=self.ignore_index, **model_kwargs,
                )
            captured = self._captured
        finally:
            self._captured = None
        if loss_weight is not None:
            return self._weighted_sum(loss_sum, loss_weight)
        if self.router_aux is None:
            return global_token_mean(loss_sum, count, group=self._group, comm=self._comm)
        return self._with_router_aux(loss_sum, count, captured or [], token_mask)

    def model_inputs(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, *, document_starts: torch.Tensor | None = None,
        chunk_assignment: torch.Tensor | None = None, bidirectional_spans: torch.Tensor | None = None,
        mrope_position_ids: torch.Tensor | None = None, media_index: torch.Tensor | None = None,
        **media: torch.Tensor,
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, Any]]:
        """(input_ids, position_ids, model keywords) for the local loss from a loader batch: ``attention_kwargs``;
        for a batch with images or videos, ``input_ids`` None, the M-RoPE positions and this rank's
        ``inputs_embeds`` (``adapters/vision.py``)."""
        kwargs = self.attention_kwargs(position_ids, document_starts, chunk_assignment, bidirectional_spans)
        if media:
            return None, self._vision_inputs(input_ids, position_ids, mrope_position_ids, media_index, media,
                                             kwargs), kwargs
        if self.vision is not None and self.vision.refusal is None:  # text only: the tower still gets a zero gradient
            embeds, extra = self.vision.inputs(input_ids, None, {}, group=self._group, comm=self._comm)
            kwargs.update(inputs_embeds=embeds, **extra)
            return None, position_ids, kwargs
        return input_ids, position_ids, kwargs

    def _vision_inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor, rope_positions: torch.Tensor | None,
                       media_index: torch.Tensor | None, media: dict[str, torch.Tensor],
                       model_kwargs: dict[str, Any]) -> torch.Tensor:
        """A batch with images or videos: this rank's embeddings into ``model_kwargs``; the positions (M-RoPE's where
        the loader computed them, else the text's)."""
        unknown = sorted(set(media) - set(MEDIA_KEYS))
        if unknown:
            raise TypeError(f"unexpected batch keys {unknown} for the sequence-parallel loss module")
        if self.vision is None or getattr(self.vision, "refusal", None):
            raise ValueError(getattr(self.vision, "refusal", None) or
                             f"{type(self.lm).__name__} has no vision tower: this batch carries images or videos")
        if media_index is None:
            raise ValueError("a batch with images or videos needs the loader's media_index (and, for M-RoPE models, "
                             "mrope_position_ids): shard it with sp.dataloader / sp.shard")
        embeds, extra = self.vision.inputs(input_ids, media_index, media, group=self._group, comm=self._comm)
        model_kwargs.update(inputs_embeds=embeds, **extra)
        return rope_positions if rope_positions is not None else position_ids

    def _weighted_sum(self, loss_sum: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The group's summed token losses x ``weight`` (Note [Dynamic sequence parallelism])."""
        total = loss_sum.double().reshape(1)
        if self._sp_size > 1:
            total = _SumOverRanks.apply(total, self._comm, self._group)
        return (total[0] * weight.to(device=total.device, dtype=torch.float64).reshape(-1)[0]).float()

    def _with_router_aux(
        self, loss_sum: torch.Tensor, count: torch.Tensor, router_logits: list[torch.Tensor],
        token_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        aux = self.router_aux
        if torch.is_grad_enabled() and self.training and any(not r.requires_grad for r in router_logits):
            raise RuntimeError(
                "router logits carry no gradient (reentrant activation checkpointing runs the layers without "
                "autograd), so the router aux loss would not train the router: use non-reentrant checkpointing "
                '("mini_sequence": {"activation_checkpointing": "torch"}, or activation_checkpointing_enable('
                'activation_checkpointing_kwargs={"use_reentrant": False}))'
            )
        stats = aux.statistics(router_logits, token_mask)  # [2E + 1] this rank's sums
        dev = loss_sum.device
        # one all-gather for the LM loss and the router statistics; fp64 keeps token counts exact
        both = torch.cat([
            loss_sum.double().reshape(1), count.detach().to(device=dev, dtype=torch.float64).reshape(1),
            stats.to(device=dev, dtype=torch.float64),
        ])
        total = _SumOverRanks.apply(both, self._comm, self._group)
        lm_loss = (total[0] / total[1].clamp(min=1)).float()
        aux_loss = aux.combine(total[2:])
        self.last_aux_loss = aux_loss.detach()
        return lm_loss + aux.coef * aux_loss
