"""``WallfacerGRPOTrainer`` and ``WallfacerRLOOTrainer``: TRL's ``GRPOTrainer`` and ``RLOOTrainer`` with sequence
parallelism, one changed line (``GRPOTrainer(...)`` -> ``WallfacerGRPOTrainer(...)``, ``RLOOTrainer(...)`` ->
``WallfacerRLOOTrainer(...)``, a ``"wallfacer"`` section in the ds_config of ``GRPOConfig(deepspeed=...)`` /
``RLOOConfig(deepspeed=...)``).

A step of either generates completions, scores them with the reward functions, turns the rewards into advantages
within each prompt's group (GRPO: normalised; RLOO: against the leave-one-out mean, with the KL to the reference in
the reward), and trains on per-token log-probability ratios (clipped). Under sequence parallelism:

- **Generation** runs with the model whole on each rank, with the attention it had before the setup
  (``adapters.hf.model_attention``: a KV cache over local sequences); every rank of a group generates the group's
  batch from the same random state and the group then takes its first rank's completions (one gather of token ids),
  so the group trains on one set of sequences whatever the device's nondeterminism (Note [One process per replica
  for TRL], docs/design/training.md).
- **Rewards, advantages, the completions table**: TRL's, with the group counted as one process (``replicas.py``).
- **The training step and the reference**: the fused LM head runs sequence-parallel (``fused_head.py``); TRL's loss
  (clipping, KL, importance sampling, every ``loss_type``) runs on the gathered per-token values.

Refused by name: vLLM and continuous-batching generation, custom rollouts, tool calling, image prompts. Needs ``trl``.
"""
from __future__ import annotations

from collections import defaultdict, deque
from functools import partial
from typing import Any

import torch
from trl import GRPOTrainer, RLOOTrainer

from ..adapters.hf import model_attention
from .fused_trainer import WallfacerFusedHeadMixin
from .options import UnsupportedTrainerOption

__all__ = ["WallfacerGRPOTrainer", "WallfacerRLOOTrainer", "WallfacerRolloutMixin"]


class WallfacerRolloutMixin(WallfacerFusedHeadMixin):
    """What TRL's rollout trainers (GRPO, RLOO) need beyond the fused head: generation per group, the group's
    random state, rounds and seeds counted per replica."""

    @classmethod
    def _wf_refuse_arguments(cls, kwargs: dict[str, Any]) -> None:
        args = kwargs.get("args")
        checks = [
            (bool(getattr(args, "use_vllm", False)), f"use_vllm=True (vllm_mode={getattr(args, 'vllm_mode', None)!r})",
             "generate with transformers (use_vllm=False); vLLM generation is not wired to sequence parallelism yet"),
            (bool(getattr(args, "use_transformers_continuous_batching", False)),
             "use_transformers_continuous_batching=True", "use the plain transformers generate"),
            (bool(kwargs.get("tools")) or bool(kwargs.get("environment_factory")), "tools / environments",
             "tool-calling rollouts are not supported yet"),
            (kwargs.get("rollout_func") is not None, "rollout_func",
             "a custom rollout would run per rank; use the trainer's own generation"),
        ]
        cls._wf_raise_first(checks)

    def _wf_refuse(self, run: Any) -> None:
        self._wf_raise_first([
            (bool(getattr(self, "_is_vlm", False)), "a vision-language processor", "train on text prompts"),
            (bool(getattr(self, "aux_loss_enabled", False)), "the MoE router aux loss", "set router_aux_loss_coef=0"),
        ])

    @classmethod
    def _wf_raise_first(cls, checks: list[tuple[bool, str, str]]) -> None:
        for bad, what, fix in checks:
            if bad:
                raise UnsupportedTrainerOption(f"{cls.__name__}: {what} is not supported under sequence "
                                               f"parallelism: {fix}")

    def _wf_after_setup(self) -> None:
        """TRL sizes a generation round as per_device_train_batch_size x processes x steps_per_generation and its
        sampler draws generation_batch_size / num_generations prompts a round: the processes are the replicas.
        TRL seeds each process apart (seed + process index) so processes sample different completions: here each
        replica, the ranks of a group alike."""
        args, dims = self.args, self.sequence_parallel.setup.dims
        size = args.per_device_train_batch_size * dims.dp_size * args.steps_per_generation
        if size % self.num_generations:
            raise UnsupportedTrainerOption(
                f"{type(self).__name__}: a generation round of per_device_train_batch_size "
                f"{args.per_device_train_batch_size} x {dims.dp_size} data-parallel replicas x steps_per_generation "
                f"{args.steps_per_generation} = {size} completions is not a multiple of num_generations "
                f"{self.num_generations}: change one of them"
            )
        args.generation_batch_size = size
        # the completions table TRL keeps, sized like a round (as TRL sizes it)
        self._logs = {key: defaultdict(partial(deque, maxlen=size)) if key in ("rewards", "extra")
                      else deque(maxlen=size) for key in self._logs}
        from accelerate.utils import set_seed

        set_seed(args.seed + self.sequence_parallel.groups.dp_index)

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's rollout and batching, as one process per replica, with the group's random state made one: the
        generation's sampling and the shuffle that splits a round into micro-batches draw the same numbers on every
        rank of the group (the group must train on the same rows)."""
        self._wf_share_random_state()
        with self._wf_view(self):
            return super()._prepare_inputs(generation_batch)

    def _generate_single_turn(self, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        """TRL's generation with the model's own attention; the group keeps its first rank's completion ids (GRPO
        returns them with their log-probs, RLOO alone)."""
        with model_attention(self.model):
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        if isinstance(out, tuple):
            return (self._wf_group_leaders(out[0]), *out[1:])
        return self._wf_group_leaders(out)

    def _wf_share_random_state(self) -> None:
        """The random state of the group's first rank on every rank of the group (torch's CPU generator, and the
        current device's where there is one)."""
        sp = self.sequence_parallel
        comm, group = sp.comm, sp.groups.sp_group
        with comm.phase("data"):
            cpu = comm.all_gather(comm.place(torch.random.get_rng_state()), group)[0].cpu()
            torch.random.set_rng_state(cpu)
            if comm.device is not None and comm.device.type == "cuda":
                dev = comm.all_gather(torch.cuda.get_rng_state(comm.device).to(comm.device), group)[0].cpu()
                torch.cuda.set_rng_state(dev, comm.device)

    def _wf_group_leaders(self, completion_ids: list[list[int]]) -> list[list[int]]:
        """The completions of the group's first rank, on every rank of the group (one all-gather of lengths, one
        of the token ids)."""
        sp = self.sequence_parallel
        comm, group = sp.comm, sp.groups.sp_group
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.int64)
        with comm.phase("data"):
            every = comm.all_gather(comm.place(lengths), group).cpu()  # [P, B]
            width = int(every.sum(dim=1).max())
            flat = torch.zeros(width, dtype=torch.int64)
            mine = [t for c in completion_ids for t in c]
            flat[: len(mine)] = torch.tensor(mine, dtype=torch.int64)
            ids = comm.all_gather(comm.place(flat), group)[0].cpu()
        out, start = [], 0
        for k in every[0].tolist():
            out.append(ids[start:start + k].tolist())
            start += k
        return out


class WallfacerGRPOTrainer(WallfacerRolloutMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""


class WallfacerRLOOTrainer(WallfacerRolloutMixin, RLOOTrainer):
    """``trl.RLOOTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""
