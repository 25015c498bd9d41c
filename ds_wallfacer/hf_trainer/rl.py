"""``WallfacerGRPOTrainer`` and ``WallfacerRLOOTrainer``: TRL's ``GRPOTrainer`` and ``RLOOTrainer`` with sequence
parallelism, one changed line (``GRPOTrainer(...)`` -> ``WallfacerGRPOTrainer(...)``, ``RLOOTrainer(...)`` ->
``WallfacerRLOOTrainer(...)``, a ``"wallfacer"`` section in the ds_config of ``GRPOConfig(deepspeed=...)`` /
``RLOOConfig(deepspeed=...)``).

A step of either generates completions, scores them with the reward functions, turns the rewards into advantages
within each prompt's group (GRPO: normalised; RLOO: against the leave-one-out mean, with the KL to the reference in
the reward), and trains on per-token log-probability ratios (clipped). Under sequence parallelism:

- **Generation** is split over the group: each rank generates its share of the group's prompts (contiguous
  slices, sizes differing by at most one) with the model whole and the attention it had before the setup
  (``adapters.hf.model_attention``: a KV cache over its own sequences), and the group all-gathers the completions,
  so every rank holds the whole batch in the prompts' order and the group trains on one set of sequences
  (``rollouts.py``). Sampling: rank i of a group draws from generators seeded with ``s + i``, ``s`` drawn from a copy
  of the group's shared random state, which is left as it was (Note [Seeds of a split rollout] in ``rollouts.py``;
  Note [One process per replica for TRL], docs/design/training.md); greedy decoding equals one process generating
  the whole batch. A rank without prompts generates one and drops it, so that under ZeRO-3 every rank enters
  ``generate`` (its parameter gather, its steps synced across ranks) as often as the others.
- **Custom and multi-turn rollouts** (GRPO; ``custom_rollouts.py``, Note [Custom rollouts and tools in a group]): a
  ``rollout_func`` runs on each rank's share of the prompts and the group merges the outputs (its ``env_mask`` is
  TRL's tool mask); TRL's tool loop runs on every rank over the group's batch, its generation split like the rest;
  environments and async tools run on every rank, plain standalone tools once, on the group's first rank, which sends
  the result; after each rollout the group checks that its ranks made the same rows and raises naming the
  environments and tools if not.
- **Generation with vLLM** (``use_vllm=True``, ``vllm_mode="server"`` or ``"colocate"``): a server generates each
  replica's prompts once and every rank of the group gets its replica's completions; colocated engines take the
  split above, one engine per rank (``vllm_rollouts.py``, Note [vLLM server under sequence parallelism], Note
  [Colocated vLLM under sequence parallelism]).
- **Rewards, advantages, the completions table**: TRL's, with the group counted as one process (``replicas.py``).
- **The training step and the reference**: the fused LM head runs sequence-parallel (``fused_head.py``); TRL's loss
  (clipping, KL, importance sampling, every ``loss_type``) runs on the gathered per-token values, masked by TRL's
  completion and tool masks as on one process (the packed rows hold every token the attention mask holds).

Refused by name: continuous-batching generation (its engine runs outside the group's split), colocated vLLM with
``vllm_tensor_parallel_size`` > 1 (its tensor-parallel ranks must generate alike), vLLM together with a custom
rollout, tools or environments, image prompts, and ``rollout_func`` / ``tools`` / ``environment_factory`` on RLOO
(TRL's ``RLOOTrainer`` takes none of them). Needs ``trl``.
"""
from __future__ import annotations

import inspect
import time
from collections import defaultdict, deque
from functools import partial
from typing import Any

import torch
from trl import GRPOTrainer, RLOOTrainer

from ..adapters.hf import model_attention
from .custom_rollouts import GroupRolloutFunc, RolloutMismatch, check_same_rows, share_sync_tools
from .fused_trainer import WallfacerFusedHeadMixin
from .options import UnsupportedTrainerOption
from .phases import PhaseClockMixin
from .rollouts import gather_rows, generation_seed, prompt_share, seeded_generation
from .vllm_rollouts import WallfacerVLLMMixin, vllm_refusals

__all__ = ["WallfacerGRPOTrainer", "WallfacerRLOOTrainer", "WallfacerRolloutMixin"]


class WallfacerRolloutMixin(PhaseClockMixin, WallfacerVLLMMixin, WallfacerFusedHeadMixin):
    """What TRL's rollout trainers (GRPO, RLOO) need beyond the fused head: generation per group, the group's
    random state, rounds and seeds counted per replica."""

    redundant_rollouts: bool = False
    """True: every rank of a group generates the group's whole batch and the group keeps its first rank's
    completions (P times the generation work and memory); the benchmark's baseline (``benchmarks/bench_rl.py``),
    set on the trainer before ``train()``. False (the default): each rank generates its share. With a ``rollout_func``:
    every rank calls it on the whole batch (Note [Custom rollouts and tools in a group])."""

    custom_rollouts: bool = False
    """Whether the TRL trainer takes ``rollout_func``, ``tools`` and ``environment_factory`` (``custom_rollouts.py``
    runs them per group); without, they are refused by name."""

    _wf_local_rollout: bool = False
    """True while a user's ``rollout_func`` runs on this rank's share: the trainer's generation is then local."""

    @classmethod
    def _wf_refuse_arguments(cls, kwargs: dict[str, Any]) -> None:
        args = kwargs.get("args")
        custom = [name for name in ("rollout_func", "tools", "environment_factory") if kwargs.get(name)]
        checks = [
            *vllm_refusals(kwargs),
            (bool(getattr(args, "use_transformers_continuous_batching", False)),
             "use_transformers_continuous_batching=True", "use the plain transformers generate"),
            (bool(custom) and not cls.custom_rollouts, " / ".join(custom),
             "custom rollouts are wired for GRPO only (TRL's RLOOTrainer takes none of them); use "
             "WallfacerGRPOTrainer"),
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
        self._wf_rollout_counts: dict[str, float] = {"prompts": 0, "tokens": 0, "batch_tokens": 0,
                                                       "seconds": 0.0}
        # the completions table TRL keeps, sized like a round (as TRL sizes it)
        self._logs = {key: defaultdict(partial(deque, maxlen=size)) if key in ("rewards", "extra")
                      else deque(maxlen=size) for key in self._logs}
        from accelerate.utils import set_seed

        set_seed(args.seed + self.sequence_parallel.groups.dp_index)
        if getattr(self, "rollout_func", None) is not None:  # each rank runs it on its share of the prompts
            self.rollout_func = GroupRolloutFunc(self.rollout_func)

    def _prepare_inputs(self, generation_batch: Any) -> Any:
        """TRL's rollout and batching, as one process per replica, with the group's random state made one: the
        ranks' generation seeds derive from it (Note [Seeds of a split rollout] in ``rollouts.py``) and the shuffle
        that splits a round into micro-batches draws the same numbers on every rank of the group (the group must
        train on the same rows)."""
        self._wf_share_random_state()
        with self._wf_view(self):
            return super()._prepare_inputs(generation_batch)

    def _generate(self, prompts: list) -> Any:
        """TRL's rollout of the replica's prompts. With a ``rollout_func``, tools or environments (Note [Custom
        rollouts and tools in a group] in ``custom_rollouts.py``): the plain standalone tools run on the group's
        first rank, the group checks that its ranks made the same rows, and takes its first rank's random state."""
        if getattr(self, "rollout_func", None) is None and not getattr(self, "tools", None):
            return super()._generate(prompts)
        faults: list[str] = []
        if self.tools:
            share_sync_tools(self, faults)
        out = super()._generate(prompts)
        if faults:  # TRL's tool loop caught them as failed calls
            raise RolloutMismatch(f"{type(self).__name__}: {faults[0]}")
        prompt_ids, completion_ids, tool_mask, _, logprobs = out[:5]
        sp = self.sequence_parallel
        check_same_rows((prompt_ids, completion_ids, tool_mask, logprobs), comm=sp.comm, group=sp.groups.sp_group,
                        sources=self._wf_rollout_sources(), trainer=type(self).__name__)
        self._wf_share_random_state()
        return out

    def _wf_rollout_sources(self) -> str:
        """What runs on every rank of a group in a custom rollout, by name (for ``RolloutMismatch``)."""
        pools = getattr(self, "_environment_pool", None) or {}
        envs = sorted({type(e).__name__ for pool in pools.values() for e in pool})
        tools = [getattr(t, "__name__", "?") for t in getattr(self, "_standalone_tools", None) or []
                 if inspect.iscoroutinefunction(t)]
        named = ([f"environments {envs}"] if envs else []) + ([f"async tools {tools}"] if tools else [])
        return "The " + " and ".join(named) if named else "Tools and environments"

    def _generate_single_turn(self, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        """TRL's generation with the model's own attention, split over the group: this rank generates its share
        of ``prompt_ids`` and the group all-gathers the completion ids (and the per-token log-probabilities where
        TRL returns them), so every rank returns TRL's result for the whole list, in its order. GRPO returns
        ``(completion_ids, logprobs)``, RLOO the ids alone. Note [Seeds of a split rollout] in ``rollouts.py``."""
        if self._wf_local_rollout:  # called by a rollout_func on this rank's share: not split again
            with model_attention(self.model):
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)
        if self._wf_on_vllm_server():  # the server generates the replica's prompts once (vllm_rollouts.py)
            return self._wf_generate_on_server(prompt_ids, *args, **kwargs)
        if self.redundant_rollouts:
            return self._wf_generate_redundant(prompt_ids, *args, **kwargs)
        t0, sp = time.perf_counter(), self.sequence_parallel
        parts, index = sp.setup.dims.sp_size, sp.groups.sp_index
        start, stop = prompt_share(len(prompt_ids), parts=parts, index=index)
        # A rank without prompts generates the first one and drops it: under ZeRO-3 every rank must enter
        # generate as often as its peers (the parameter gather, and the steps synced across ranks).
        mine = prompt_ids[start:stop] or prompt_ids[:1]
        seed = generation_seed(torch.random.get_rng_state(), index=index)
        with model_attention(self.model), seeded_generation(seed, device=sp.comm.device):
            out = super()._generate_single_turn(mine, *args, **kwargs)
        ids, logprobs = out if isinstance(out, tuple) else (out, None)
        group = dict(max_rows=-(-len(prompt_ids) // parts), comm=sp.comm, group=sp.groups.sp_group)  # longest share
        every = gather_rows(ids[: stop - start], **group)
        if logprobs is not None:
            logprobs = gather_rows(logprobs[: stop - start], dtype=torch.float64, **group)
        self._wf_count_rollout(ids, every, prompts=stop - start, seconds=time.perf_counter() - t0)
        return (every, logprobs) if isinstance(out, tuple) else every

    def _wf_generate_redundant(self, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        """Every rank generates the whole list (the group keeps its first rank's completions): the benchmark's
        baseline (``redundant_rollouts``)."""
        t0, sp = time.perf_counter(), self.sequence_parallel
        with model_attention(self.model):
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        ids, logprobs = out if isinstance(out, tuple) else (out, None)
        group = dict(max_rows=len(ids), comm=sp.comm, group=sp.groups.sp_group)
        first = gather_rows(ids, **group)[: len(ids)]
        if logprobs is not None:
            logprobs = gather_rows(logprobs, dtype=torch.float64, **group)[: len(ids)]
        self._wf_count_rollout(ids, first, prompts=len(prompt_ids), seconds=time.perf_counter() - t0)
        return (first, logprobs) if isinstance(out, tuple) else first

    def _wf_count_rollout(self, generated: list[list[int]], batch: list[list[int]], *, prompts: int,
                          seconds: float) -> None:
        """``rollout_stats``'s counts: ``generated`` by this rank (a dropped row included), ``batch`` the group's."""
        counts = self._wf_rollout_counts
        counts["prompts"] += prompts
        counts["tokens"] += sum(len(c) for c in generated)
        counts["batch_tokens"] += sum(len(c) for c in batch)
        counts["seconds"] += seconds

    def rollout_stats(self) -> list[dict[str, float]]:
        """What each rank of this rank's group generated so far, in group-rank order: ``prompts`` (those it
        generated for the group), ``tokens`` (every completion token it generated, a dropped row's included),
        ``batch_tokens`` (the completion tokens of the batches the group trained on: the same on every rank) and
        ``seconds`` (in rollouts: generation and the group's gather). Collective over the group: call it on every
        rank."""
        keys, sp = ("prompts", "tokens", "batch_tokens", "seconds"), self.sequence_parallel
        mine = torch.tensor([self._wf_rollout_counts[k] for k in keys], dtype=torch.float64)
        with sp.comm.phase("data"):
            every = sp.comm.all_gather(sp.comm.place(mine), sp.groups.sp_group).cpu()  # [4] -> [P, 4]
        return [{k: (float(v) if k == "seconds" else int(v)) for k, v in zip(keys, row)} for row in every.tolist()]

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


class WallfacerGRPOTrainer(WallfacerRolloutMixin, GRPOTrainer):
    """``trl.GRPOTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""

    custom_rollouts = True


class WallfacerRLOOTrainer(WallfacerRolloutMixin, RLOOTrainer):
    """``trl.RLOOTrainer`` with the ds_config's ``"wallfacer"`` sequence parallelism."""
