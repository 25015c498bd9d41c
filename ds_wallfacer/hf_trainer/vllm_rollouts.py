"""TRL's vLLM generation (``GRPOConfig(use_vllm=True)``, ``RLOOConfig(use_vllm=True)``) under sequence parallelism:
what the two modes need to generate once per replica and train every rank of a group on the same completions.

TRL builds its ``trl.generation.VLLMGeneration`` in the trainer's constructor, before the sequence-parallel setup,
with the real accelerator; the trainers call its ``sync_weights`` (when the optimizer step changed) and ``generate``
from ``_generate_single_turn``. Under sequence parallelism the P ranks of a group hold the same prompts (the replica's),
so the two modes need different wiring.

Note [vLLM server under sequence parallelism]. In ``vllm_mode="server"`` TRL's ``generate`` gathers every process's
prompts (``gather_object``), the main process posts the unique ones to the server once (``n=num_generations``),
broadcasts the answer, and each process takes the slice ``process_index * len(prompts)``. Run on all W ranks as they
are, the server would get every group's prompts P times (P times the work) and, sampling, the ranks of a group would
get different completions for the same rows: silently wrong. So the group does not split its prompts here: every rank
calls TRL's ``_generate_single_turn`` with the replica's whole list while ``VLLMGeneration`` sees the replica view of
the accelerator (``replicas.ReplicaView``: D processes, ``process_index`` the replica) and the replica-aware
``gather_object`` in its module. Then the gather keeps one copy of each replica's prompts (its first rank's), the one
request is the request of a D-process TRL run, the broadcast (from global rank 0, the first replica's first rank)
reaches every rank, and every rank of replica d takes replica d's completions and per-token log-probabilities. Every
rank takes part in each collective (the gathers, the broadcast, ZeRO-3's parameter gathers), as TRL needs.

Weights: TRL's ``sync_weights`` runs on every rank (the trainer calls it on every rank when ``global_step`` moved):
each parameter (under LoRA: all of them, with the adapter merged) is gathered from its ZeRO-3 partitions by every rank
together, and only the main process (global rank 0: ``is_main_process`` is the real accelerator's) streams it to the
server over vLLM's NCCL weight-transfer engine. So the weights are pushed once per optimizer step, by one process.
The model's parameters keep their names and shapes under the setup (the attention and the sharded fused LM head are
attributes and a wrapped forward, not modules), so the pushed names are the checkpoint's.

Note [Colocated vLLM under sequence parallelism]. In ``vllm_mode="colocate"`` every rank holds its own engine
(``vllm.LLM``, the whole model, on its device) and TRL's ``generate`` generates the prompts it is given, one
completion each, without collectives. The group's split (``rl.py``, ``rollouts.py``) applies as with transformers'
``generate``: each rank's engine generates its share of the group's prompts and the group all-gathers the completion
ids and log-probabilities; a rank with an empty share generates one prompt and drops it, so that every rank calls
``sync_weights`` (ZeRO-3 gathers; with sleep mode, inside ``generate``) as often as the others. Seeding: TRL builds
each engine with ``seed=process_index // vllm_tensor_parallel_size``, the global rank here (TRL builds it with the
real accelerator), and the split runs each call under ``seeded_generation(s + i)`` (Note [Seeds of a split rollout]);
which of the two an engine's sampler draws from is vLLM's choice (its own per-engine state, or torch's generator of
the device for an in-process engine); either way the ranks draw apart and a run is reproducible, and the group
trains on the gathered completions whatever was drawn. ``vllm_tensor_parallel_size`` > 1 is refused: TRL's tensor-
parallel group gathers equal numbers of prompts from consecutive ranks and needs them to sample alike, while the
ranks of a sequence-parallel group hold shares of different sizes and draw apart.

Only the server mode's HTTP side runs without a GPU; ``tests/hf_trainer/test_trl_vllm.py`` checks it against a stand-in
server (our side of the protocol, not vLLM), ``benchmarks/gpu_check.sh`` runs real vLLM in both modes on one GPU.
"""
from __future__ import annotations

import time
from typing import Any

from .options import UnsupportedTrainerOption
from .replicas import ReplicaView

__all__ = ["WallfacerVLLMMixin", "vllm_refusals"]


def vllm_refusals(kwargs: dict[str, Any]) -> list[tuple[bool, str, str]]:
    """(refused, the setting, what to do) for the vLLM options sequence parallelism cannot run exactly; read from the
    trainer's constructor arguments alone, before TRL builds its engine."""
    args = kwargs.get("args")
    use = bool(getattr(args, "use_vllm", False))
    mode = getattr(args, "vllm_mode", None)
    tp = getattr(args, "vllm_tensor_parallel_size", 1) or 1
    custom = [name for name in ("rollout_func", "tools", "environment_factory") if kwargs.get(name)]
    return [
        (use and mode == "colocate" and tp > 1, f"vllm_tensor_parallel_size={tp} with vllm_mode='colocate'",
         "the ranks of a vLLM tensor-parallel group must generate the same prompts from one seed, while the ranks of "
         "a sequence-parallel group generate shares of different sizes from different seeds; set "
         "vllm_tensor_parallel_size=1, or use vllm_mode='server' (the server has its own tensor parallelism)"),
        (use and bool(custom), f"use_vllm=True with {' / '.join(custom)}",
         "a custom or multi-turn rollout would call vLLM per rank, outside the group's wiring; generate with "
         "transformers (use_vllm=False) for it, or drop it"),
    ]


class WallfacerVLLMMixin:
    """Generation through a vLLM server for the rollout trainers (Note [vLLM server under sequence parallelism]);
    the colocated engines take the group's split path in ``rl.py`` unchanged."""

    def _wf_on_vllm_server(self) -> bool:
        """True when TRL generates through a vLLM server (``use_vllm=True``, ``vllm_mode="server"``)."""
        return bool(getattr(self, "use_vllm", False)) and getattr(self, "vllm_mode", None) == "server"

    def _wf_generate_on_server(self, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        """TRL's ``_generate_single_turn`` on the replica's whole prompt list, with ``VLLMGeneration`` seeing one
        process per replica: the server generates each replica's prompts once and every rank of the group returns
        its replica's completions (GRPO: and their log-probabilities), in the prompts' order."""
        if getattr(self, "redundant_rollouts", False):
            raise UnsupportedTrainerOption(
                f"{type(self).__name__}: redundant_rollouts is the baseline of a generation split over the group; "
                "with vllm_mode='server' the server generates and no rank does: leave redundant_rollouts False"
            )
        t0 = time.perf_counter()
        with self._wf_vllm_view()(self.vllm_generation):
            out = super()._generate_single_turn(prompt_ids, *args, **kwargs)
        ids = out[0] if isinstance(out, tuple) else out
        self._wf_count_rollout([], ids, prompts=0, seconds=time.perf_counter() - t0)  # the server generated
        return out

    def _wf_vllm_view(self) -> ReplicaView:
        """The replica view for TRL's ``VLLMGeneration`` and its module's ``gather_object`` (made once, from the real
        accelerator TRL gave it)."""
        view = self.__dict__.get("_wf_vllm_replicas")
        if view is None:
            import trl.generation.vllm_generation as module

            sp = self.sequence_parallel
            view = ReplicaView(self.vllm_generation.accelerator, dims=sp.setup.dims, dp_index=sp.groups.dp_index,
                               module=module)
            self.__dict__["_wf_vllm_replicas"] = view
        return view
