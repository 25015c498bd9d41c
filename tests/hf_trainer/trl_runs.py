"""One run of TRL's DPO or GRPO trainer on a rank of ``tests.dist_utils.run_distributed``: the tiny Llama with the
byte-level chat tokenizer, the shipped synthetic arithmetic data, SGD without clipping; TRL's own trainer
(``section=None``) or the Wallfacer one with that ``"wallfacer"`` section. Returns rank 0's log history.

``SlicedRollouts`` makes TRL's GRPO and RLOO trainers generate as a sequence-parallel group of P ranks does
(``hf_trainer/rollouts.py``): the process's prompts in P contiguous slices, slice i sampled from generators seeded
``s + i``, so that sampled completions, and with them every loss term, can be compared with the split run."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .rollout_cases import rollout_setup
from .runs import checkpoint_args, ds_config, train_steps

STEPS = 3


def _lora(*, identity: bool = True) -> Any:
    """A LoRA config; ``identity=False``: B random too, so the adapted model starts away from its base (the
    reference), and GRPO's KL term has a gradient from the first step."""
    from peft import LoraConfig

    torch.manual_seed(1)  # LoRA's matrices: the same on every rank and in the reference
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights="gaussian" if identity else False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])


class SlicedRollouts:
    """Mixed into TRL's ``GRPOTrainer`` / ``RLOOTrainer``: TRL's generation, of this process's prompts cut into
    ``rollout_parts`` contiguous slices (``prompt_share``), slice i under ``seeded_generation(generation_seed(state,
    index=i))`` with ``state`` the process's CPU random state on entry, the completions concatenated in the prompts'
    order. A sequence-parallel group of ``rollout_parts`` ranks generates the same: its ranks share their replica's
    state, which on one process per replica is this one (``WallfacerRolloutMixin._generate_single_turn``). All else
    (rewards, advantages, the loss, the metrics, the completions table) is TRL's."""

    rollout_parts: int = 1

    def _generate_single_turn(self, prompt_ids: list, *args: Any, **kwargs: Any) -> Any:
        from ds_wallfacer.hf_trainer.rollouts import generation_seed, prompt_share, seeded_generation

        state, outs = torch.random.get_rng_state(), []
        for index in range(self.rollout_parts):
            start, stop = prompt_share(len(prompt_ids), parts=self.rollout_parts, index=index)
            if start < stop:
                with seeded_generation(generation_seed(state, index=index), device=self.accelerator.device):
                    outs.append(super()._generate_single_turn(prompt_ids[start:stop], *args, **kwargs))
        if not isinstance(outs[0], tuple):  # RLOO: the completion ids
            return [c for out in outs for c in out]
        ids = [c for out, _ in outs for c in out]  # GRPO: (ids, per-token log-probs or None)
        logprobs = None if any(lp is None for _, lp in outs) else [row for _, lp in outs for row in lp]
        return ids, logprobs


def _unpaired(pairs: list[dict[str, str]]) -> list[dict[str, Any]]:
    """Preference pairs -> KTO's unpaired rows: the chosen completion desirable, the rejected one not."""
    return [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
            for p in pairs for key in ("chosen", "rejected")]


def _on_disk(path: Path, rows: list[dict[str, Any]]) -> Any:
    """``rows`` as a dataset saved under ``path`` by rank 0 and loaded by every rank (after the process group
    exists: the Trainer's arguments start it)."""
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk

    if dist.get_rank() == 0:
        Dataset.from_list(rows).save_to_disk(str(path))
    dist.barrier()
    return load_from_disk(str(path))


def _history(trainer: Any, steps_run: list[int]) -> dict[str, Any]:
    logs = [h for h in trainer.state.log_history if "loss" in h]
    sp = getattr(trainer, "sequence_parallel", None)
    return {"logs": logs, "steps_run": steps_run,
            "sequence_parallel_size": sp.setup.dims.sp_size if sp is not None else 1}


def dpo_train(rank: int, world: int, out: str, section: dict | None, micro_batch: int,
              options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``STEPS`` DPO (``options["algo"] == "kto"``: KTO, each pair as two unpaired completions) steps (gradient
    accumulation 2), then evaluation. ``options``: ``lora`` (the reference is the base model), ``precompute``
    (``precompute_ref_log_probs``), ``zero_stage`` (default 2), ``loss_type``, ``save_steps`` (checkpoints),
    ``resume`` (a checkpoint folder to resume from); without LoRA or precompute the reference is a second copy of
    the initial model."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer

    from ds_wallfacer.hf_trainer.chat import chat_tokenizer
    from ds_wallfacer.hf_trainer.rl_data import make_preferences
    from tests.models import tiny_model

    opts = options or {}
    kto = opts.get("algo") == "kto"
    config_kwargs = {} if kto else {"loss_type": opts.get("loss_type", ["sigmoid"])}
    args = (KTOConfig if kto else DPOConfig)(
        output_dir=out, per_device_train_batch_size=micro_batch, per_device_eval_batch_size=micro_batch,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=0.5, lr_scheduler_type="constant",
        max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, disable_tqdm=True, use_cpu=True, bf16=False,
        deepspeed=ds_config(section, zero_stage=opts.get("zero_stage", 2)), beta=0.5,
        precompute_ref_log_probs=opts.get("precompute", False), **checkpoint_args(opts), **config_kwargs,
    )
    train, evaluation = make_preferences(24, seed=1, filler=1), make_preferences(4, seed=2, filler=1)
    if kto:
        train, evaluation = _unpaired(train), _unpaired(evaluation)
    if opts.get("precompute"):  # TRL caches the reference log-probs beside the dataset: one every rank can read
        train, evaluation = _on_disk(Path(out) / "train", train), _on_disk(Path(out) / "eval", evaluation)
    else:
        train, evaluation = Dataset.from_list(train), Dataset.from_list(evaluation)
    kwargs: dict[str, Any] = dict(model=tiny_model("llama", seed=0), args=args, processing_class=chat_tokenizer(),
                                  train_dataset=train, eval_dataset=evaluation)
    if opts.get("lora"):
        kwargs["peft_config"] = _lora()
    elif not opts.get("precompute"):
        kwargs["ref_model"] = tiny_model("llama", seed=0)
    if section is None:
        trainer = (KTOTrainer if kto else DPOTrainer)(**kwargs)
    else:
        from ds_wallfacer.hf_trainer import WallfacerDPOTrainer, WallfacerKTOTrainer

        trainer = (WallfacerKTOTrainer if kto else WallfacerDPOTrainer)(**kwargs)
    steps_run = train_steps(trainer, resume=opts.get("resume"))
    metrics = trainer.evaluate()
    return {**_history(trainer, steps_run), "eval": metrics}


def grpo_train(rank: int, world: int, out: str, section: dict | None, micro_batch: int,
               options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``STEPS`` GRPO (``options["algo"] == "rloo"``: RLOO) steps: ``num_generations`` (default 4) completions per
    prompt, greedy (``sampling``: at temperature 1), the arithmetic reward (greedy: and ``row_bonus``), gradient
    accumulation 2. ``options``: ``lora`` (greedy: the adapter starts away from the base, see ``_lora``; sampling:
    at the base), ``beta`` (default 0.1: the KL to the reference, the base model under LoRA, else a second model TRL
    loads from ``pretrained``), ``pretrained`` (a saved tiny model, the policy's and reference's checkpoint),
    ``zero_stage``, ``loss_type``, ``vllm_server`` (the URL of a ``vllm_standin.StandInServer``: TRL's vLLM server mode,
    generating there), ``rollout_parts`` (TRL's trainer, ``section=None``: generate as a group of that
    many ranks, ``SlicedRollouts``), ``rollout`` (a custom rollout, ``rollout_cases.py``: ``"scripted"`` or
    ``"tools"``), ``save_steps`` (checkpoints), ``resume`` (a checkpoint folder to resume from).
    Returns this rank's log history, the steps this run trained, TRL's completions table, a digest of the trained
    parameters and (the Wallfacer trainer) what each rank of its group generated."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer

    from ds_wallfacer.hf_trainer.chat import chat_tokenizer
    from ds_wallfacer.hf_trainer.rl_data import arithmetic_reward, make_prompts
    from tests.models import tiny_model

    opts = options or {}
    rloo, sampling = opts.get("algo") == "rloo", opts.get("sampling", False)
    server = opts.get("vllm_server")
    tokenizer, rewards = chat_tokenizer(), [arithmetic_reward] if sampling else [arithmetic_reward, row_bonus]
    rows = make_prompts(16, seed=1, filler=0 if opts.get("rollout") == "tools" else 1)
    config_kwargs, custom = {} if rloo else {"loss_type": opts.get("loss_type", "grpo")}, {}
    if opts.get("rollout"):  # the same custom rollout for TRL's trainer and ours
        rollout_config, custom, rows = rollout_setup(opts["rollout"], tokenizer, rows, rewards)
        config_kwargs.update(rollout_config)
    args = (RLOOConfig if rloo else GRPOConfig)(**{
        **dict(output_dir=out, per_device_train_batch_size=micro_batch, gradient_accumulation_steps=2,
               max_steps=STEPS, learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1,
               report_to=[], seed=0, disable_tqdm=True, use_cpu=True, bf16=False, **checkpoint_args(opts),
               deepspeed=ds_config(section, zero_stage=opts.get("zero_stage", 2)),
               num_generations=opts.get("num_generations", 4), max_completion_length=12, temperature=1.0,
               generation_kwargs=None if sampling or server else {"do_sample": False}, beta=opts.get("beta", 0.1),
               num_iterations=opts.get("num_iterations", 1),
               gradient_checkpointing=opts.get("gradient_checkpointing", True), **_server_args(server)),
        **config_kwargs,
    })
    if opts.get("pretrained") and opts.get("zero_stage") == 3:
        import deepspeed

        # TRL loads the checkpoint under zero.Init, sized by DeepSpeed's world; use_cpu does not start it
        deepspeed.init_distributed(dist_backend="gloo")
    model = opts["pretrained"] if opts.get("pretrained") else tiny_model("llama", seed=0)
    kwargs: dict[str, Any] = {"model": model, "args": args, "processing_class": tokenizer, "reward_funcs": rewards,
                              "train_dataset": Dataset.from_list(rows), **custom}
    if server:  # TRL's client, its CUDA parts replaced, to the stand-in server (vllm_standin.py)
        from .vllm_standin import use_standin_client

        use_standin_client()
    if opts.get("lora"):
        kwargs["peft_config"] = _lora(identity=sampling)  # greedy: the KL term is what trains the adapter
    if section is None:
        base = RLOOTrainer if rloo else GRPOTrainer
        parts = opts.get("rollout_parts", 1)
        if parts > 1:
            base = type(f"Sliced{base.__name__}", (SlicedRollouts, base), {"rollout_parts": parts})
        trainer = base(**kwargs)
    else:
        from ds_wallfacer.hf_trainer import WallfacerGRPOTrainer, WallfacerRLOOTrainer

        trainer = (WallfacerRLOOTrainer if rloo else WallfacerGRPOTrainer)(**kwargs)
    steps_run = train_steps(trainer, resume=opts.get("resume"))
    table = trainer._logs  # TRL's completions table (the last round): one row per completion, every column aligned
    return {**_history(trainer, steps_run),
            "table": {"prompt": list(table["prompt"]), "completion": list(table["completion"]),
                      "advantages": list(table["advantages"])},
            "digest": _digest(trainer.model_wrapped),
            "rollouts": trainer.rollout_stats() if section is not None else None,
            "phases": trainer.phase_stats() if section is not None else None}


def _server_args(url: str | None) -> dict[str, Any]:
    """The config keys of TRL's vLLM server mode with the server at ``url`` (none without one)."""
    if url is None:
        return {}
    return {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": url, "vllm_server_timeout": 30.0}


def row_bonus(completions: list, **kwargs: Any) -> list[float]:
    """0, 0.1, 0.2, 0.3 by the row's place among each 4 of the batch: greedy completions of one prompt are alike, and
    this gives them different rewards, so the advantages, their normalisation and the reward statistics are not
    degenerate (a zero spread, which a KL term's rounding in the reward would make fragile)."""
    return [0.1 * (i % 4) for i in range(len(completions))]


def _digest(model: torch.nn.Module) -> list[float]:
    """Each trainable parameter's sum and sum of squares (in float64), whole under ZeRO-3 (collective)."""
    import deepspeed

    params = [p for p in model.parameters() if p.requires_grad]
    with deepspeed.zero.GatheredParameters(params):
        return [float(v) for p in params for v in (p.double().sum(), p.double().square().sum())]


def save_tiny_llama(path: str) -> str:
    """The tiny Llama saved as a checkpoint (what TRL loads the GRPO reference from)."""
    from tests.models import tiny_model

    model = tiny_model("llama", seed=0)
    model.config.name_or_path = path
    model.save_pretrained(path)
    return path
