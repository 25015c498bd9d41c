"""One Trainer run on a rank of ``tests.dist_utils.run_distributed``: the tiny Llama, random token sequences of
unequal lengths, the plain ``Trainer`` (``section=None``) or ``WallfacerTrainer`` with that ``"wallfacer"``
section; returns the logged losses, the eval loss and the sequence-parallel size."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

STEPS = 4
SEQ_LEN = 128


def token_sequences(n: int, *, seed: int, vocab: int = 256) -> list[dict[str, list[int]]]:
    """``n`` sequences of 64..``SEQ_LEN`` tokens (unequal lengths: padded batches, unequal token counts), each an
    arithmetic progression modulo the vocabulary with a random start and step 1..3: learnable in a few steps."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, SEQ_LEN + 1, (n,), generator=g).tolist()
    out = []
    for k in lengths:
        start, step = int(torch.randint(0, vocab - 1, (1,), generator=g)), int(torch.randint(1, 4, (1,), generator=g))
        out.append({"input_ids": [(start + i * step) % (vocab - 1) + 1 for i in range(k)]})
    return out


def pad_right(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The user's collator: right padding with an attention mask, labels = input ids with -100 on padding."""
    n = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), n, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, : len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, : len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def image_conversations(model: Any, n: int, *, seed: int) -> list[dict[str, torch.Tensor]]:
    """``n`` synthetic conversations of 30 text tokens and 4 image tokens each, in images of different shapes
    (``examples.vlm``). Every micro-batch has the same token count: the plain Trainer does not pass the step's
    token count to these models (``accepts_loss_kwargs = False``), so it averages micro-batch means, which equals
    the step's token mean only then."""
    from ds_wallfacer.examples.vlm import conversation

    shapes = [[(2, 2)], [(1, 4)], [(4, 1)]]
    return [conversation(model, text=30, images=shapes[i % 3], seed=seed * 1000 + i) for i in range(n)]


def image_batch(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """The user's VLM collator: right-padded rows, labels -100 on padding, the images concatenated."""
    from ds_wallfacer.examples.vlm import conversation_batch

    batch = conversation_batch(features)
    batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    return batch


def ds_config(section: dict | None, *, zero_stage: int = 2, top_level: dict | None = None) -> dict:
    """The Trainer's ds_config: batch sizes, clipping and lr from its arguments ("auto"), SGD, ``section`` as the
    ``"wallfacer"`` section (none when None), ``top_level`` keys added as they are (DeepSpeed's ALST keys)."""
    from tests.integration.parity import zero_section

    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "zero_optimization": zero_section(zero_stage),
        "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
        "zero_allow_untested_optimizer": True,
    }
    if section is not None:
        cfg["wallfacer"] = section
    return {**cfg, **(top_level or {})}


def train(rank: int, world: int, out: str, section: dict | None, micro_batch: int,
          options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``STEPS`` optimizer steps (gradient accumulation 2), then evaluate; rank 0's log history.
    ``options``: ``packed`` (``DataCollatorWithFlattening``: each micro-batch one row of whole sequences),
    ``save_steps`` (checkpoints), ``resume`` (a checkpoint folder to resume from),
    ``average_tokens_across_devices`` (default True, as in ``TrainingArguments``), ``zero_stage`` (default 2),
    ``activation_checkpointing`` (the Trainer's layer checkpointing), ``pretrained`` (a model folder for
    ``from_pretrained``, instead of the tiny model built here), ``lora`` (a LoRA model from ``get_peft_model``),
    ``alst`` (DeepSpeed's top-level sequence-parallel keys: ``WallfacerTrainer`` even without a section),
    ``predict`` (also ``predict()`` the held-out set, loss only), ``family`` ("qwen3_5", "lfm2": a tiny recurrent
    hybrid of the parity tests instead of the tiny Llama)."""
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    from tests.models import tiny_model

    opts = options or {}
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=micro_batch, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1.0, lr_scheduler_type="constant",
        max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, disable_tqdm=True,
        deepspeed=ds_config(section, zero_stage=opts.get("zero_stage", 2), top_level=opts.get("alst")),
        use_cpu=True, activation_checkpointing=opts.get("activation_checkpointing", False),
        average_tokens_across_devices=opts.get("average_tokens_across_devices", True),
        **checkpoint_args(opts),
    )
    if opts.get("pretrained"):  # after TrainingArguments: under ZeRO-3, built partitioned (zero.Init)
        from transformers import AutoModelForCausalLM

        import deepspeed

        # zero.Init sizes the partitions by DeepSpeed's world; TrainingArguments(use_cpu=True) does not start it
        deepspeed.init_distributed(dist_backend="gloo")
        model = AutoModelForCausalLM.from_pretrained(opts["pretrained"]).train()
    elif opts.get("family") == "qwen3_5":  # gated delta-nets (head-parallel)
        from tests.adapters.models import tiny_delta_net

        model = tiny_delta_net("qwen3_5")
    elif opts.get("family") == "lfm2":  # short convolutions (halo)
        from tests.adapters.models import tiny_lfm2

        model = tiny_lfm2("lfm2")
    elif opts.get("family") in ("qwen2_5_vl", "qwen3_vl"):  # images in every sequence
        from ds_wallfacer.examples.vlm import tiny_vlm

        model = tiny_vlm(opts["family"])
    else:
        model = tiny_model("llama", seed=0)
    if opts.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)  # LoRA's A matrices: the same on every rank and in the reference
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights="gaussian",
                                                 target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]))
    collator = DataCollatorWithFlattening() if opts.get("packed") else pad_right
    kwargs = dict(model=model, args=args, train_dataset=token_sequences(32, seed=1),
                  eval_dataset=token_sequences(8, seed=2), data_collator=collator)
    if opts.get("family") in ("qwen2_5_vl", "qwen3_vl"):
        kwargs.update(train_dataset=image_conversations(model, 16, seed=1), eval_dataset=image_conversations(
            model, 4, seed=2), data_collator=image_batch)
    if section is None and not opts.get("alst"):
        trainer = Trainer(**kwargs)
    else:
        from ds_wallfacer.hf_trainer import WallfacerTrainer

        trainer = WallfacerTrainer(**kwargs)
    steps_run = train_steps(trainer, resume=opts.get("resume"))
    return {
        **_results(trainer, kwargs["eval_dataset"], predict=opts.get("predict", False)),
        "steps_run": steps_run,
        "logged": sorted(next(h for h in trainer.state.log_history if "loss" in h)),
        "partitioned": any(hasattr(p, "ds_id") for p in model.parameters()),
        "attention_kept": _attention_kept(model),
        "batch_keys": sorted(next(iter(trainer.get_train_dataloader()))),
        "saved": sorted(p.name for p in Path(out).glob("checkpoint-*/*")),
    }


def checkpoint_args(options: dict[str, Any]) -> dict[str, Any]:
    """The training arguments for ``options["save_steps"]``: a checkpoint every that many steps, none without it."""
    save_steps = options.get("save_steps")
    return {"save_strategy": "steps" if save_steps else "no", "save_steps": save_steps or 1}


def train_steps(trainer: Any, *, resume: str | None = None) -> list[int]:
    """``trainer.train(resume_from_checkpoint=resume)``; the global steps it ran (resumed: those after the
    checkpoint)."""
    from transformers import TrainerCallback

    steps_run: list[int] = []

    class CountSteps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            steps_run.append(state.global_step)

    trainer.add_callback(CountSteps())
    trainer.train(resume_from_checkpoint=resume)
    return steps_run


def _results(trainer: Any, eval_dataset: Any, *, predict: bool = False) -> dict[str, Any]:
    """After training: evaluate (and ``predict`` the held-out set again, loss only); the logged losses, the eval
    (and test) loss, the sequence-parallel size and mode."""
    metrics = trainer.evaluate()
    if predict:
        trainer.args.prediction_loss_only = True
        metrics["test_loss"] = trainer.predict(eval_dataset).metrics["test_loss"]
    sp = getattr(trainer, "sequence_parallel", None)
    return {
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "eval_loss": metrics["eval_loss"],
        "test_loss": metrics.get("test_loss"),
        "sequence_parallel_size": sp.setup.dims.sp_size if sp is not None else 1,
        "mode": sp.setup.dims.mode if sp is not None else None,
    }


def _attention_kept(model: Any) -> dict[str, int]:
    """How checkpointed layers' recomputes got attention: replayed from the first forward, or computed again."""
    from ds_wallfacer.attention.residuals import residual_stats

    stats = residual_stats(model)
    return {"replayed": stats.replayed, "missed": stats.missed}


def refusal(rank: int, world: int, out: str, section: dict | None, trainer_kwargs: dict[str, Any],
            arg_overrides: dict[str, Any]) -> str:
    """Build ``WallfacerTrainer`` with ``trainer_kwargs`` / TrainingArguments overrides; the refusal's type and
    message."""
    from transformers import TrainingArguments

    from ds_wallfacer.hf_trainer import WallfacerTrainer
    from tests.models import tiny_model

    kw = dict(output_dir=out, per_device_train_batch_size=1, report_to=[], use_cpu=True, deepspeed=ds_config(section))
    args = TrainingArguments(**{**kw, **arg_overrides})
    trainer_kwargs = dict(trainer_kwargs)
    cls = WallfacerTrainer
    if trainer_kwargs.pop("own_loss", False):
        class OwnLoss(WallfacerTrainer):  # e.g. a preference loss
            def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
                return super().compute_loss(model, inputs, return_outputs, num_items_in_batch) * 2

        cls = OwnLoss
    try:
        cls(model=tiny_model("llama"), args=args, train_dataset=token_sequences(4, seed=0),
                         data_collator=pad_right, **trainer_kwargs)
    except ValueError as e:  # UnsupportedTrainerOption, or a ds_config error
        return f"{type(e).__name__}: {e}"
    return "not refused"


def sft_train(rank: int, world: int, out: str, section: dict | None, micro_batch: int,
              options: dict[str, Any] | None = None) -> dict[str, Any]:
    """TRL's ``SFTTrainer`` (``section=None``) or ``WallfacerSFTTrainer``: the shipped chat data, packed
    (padding-free rows, ``position_ids`` restarting per conversation) with the loss on assistant turns only,
    ``STEPS`` steps of gradient accumulation 2, then evaluation. ``options``: ``lora`` (a LoRA ``peft_config``, as
    TRL users pass it), ``zero_stage`` (default 2), ``packing`` (default True), ``images`` (the shipped image
    conversations with the tiny LLaVA and its processor, ``examples/vlm_chat.py``: TRL's vision collator, right-padded
    rows, no packing; the Wallfacer trainer then also builds one whose collator adds a key the loader does not
    shard: its refusal under ``"refusal"``), ``then_images`` (after this run, a second trainer in the same
    processes with ``images``: its results under ``"images"``)."""
    from datasets import Dataset
    from trl import SFTTrainer

    from ds_wallfacer.hf_trainer.chat import chat_tokenizer, load_chats
    from tests.models import tiny_model

    opts = options or {}
    images = bool(opts.get("images"))
    args = _sft_config(out, section, micro_batch, opts)
    if images:
        from ds_wallfacer.examples.vlm_chat import chat_processor, load_image_chats, tiny_llava

        chats = load_image_chats()
        kwargs: dict[str, Any] = dict(model=tiny_llava(seed=0), args=args, processing_class=chat_processor(),
                                      train_dataset=Dataset.from_list(chats[:16]),
                                      eval_dataset=Dataset.from_list(chats[16:20]))
    else:
        chats = load_chats()
        kwargs = dict(model=tiny_model("llama", seed=0), args=args, processing_class=chat_tokenizer(),
                      train_dataset=Dataset.from_list(chats[:48]), eval_dataset=Dataset.from_list(chats[200:216]))
    if opts.get("lora"):
        from peft import LoraConfig

        torch.manual_seed(1)  # LoRA's A matrices: the same on every rank and in the reference
        kwargs["peft_config"] = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights="gaussian",
                                           target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"])
    if section is None:
        trainer = SFTTrainer(**kwargs)
    else:
        from ds_wallfacer.hf_trainer import WallfacerSFTTrainer

        trainer = WallfacerSFTTrainer(**kwargs)
    first = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    result = {
        **_results(trainer, kwargs["eval_dataset"]),
        "logs": [h for h in trainer.state.log_history if "loss" in h],
        "eval": next(h for h in reversed(trainer.state.log_history) if "eval_loss" in h),
        "documents": int((first["position_ids"] == 0).sum()) if section is None and not images else None,
        "batch_keys": sorted(first),
        "trainable": sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)[:3],
    }
    if images and section is not None:
        result["refusal"] = _image_collator_refusal({**kwargs, "model": tiny_llava(seed=0),
                                                     "args": _sft_config(f"{out}/r", section, 1, opts)})
    if opts.get("then_images"):
        result["images"] = sft_train(rank, world, f"{out}/images", section, micro_batch, {"images": True})
    return result


def _sft_config(out: str, section: dict | None, micro_batch: int, opts: dict[str, Any]) -> Any:
    from trl import SFTConfig

    images = bool(opts.get("images"))
    return SFTConfig(
        output_dir=out, per_device_train_batch_size=micro_batch, per_device_eval_batch_size=1,
        gradient_accumulation_steps=2, max_steps=STEPS, learning_rate=1.0, lr_scheduler_type="constant",
        max_grad_norm=0.0, logging_steps=1, report_to=[], seed=0, disable_tqdm=True, use_cpu=True,
        deepspeed=ds_config(section, zero_stage=opts.get("zero_stage", 2)),
        bf16=False,  # SFTConfig's default is bf16 autocast; the comparison is in fp32
        packing=opts.get("packing", not images), eval_packing=False,
        max_length=opts.get("max_length", None if images else 256), assistant_only_loss=True, save_strategy="no",
    )


def _image_collator_refusal(kwargs: dict[str, Any]) -> str:
    """``WallfacerSFTTrainer`` with TRL's vision collator wrapped to add a key the loader does not shard (as
    Gemma 3's processor adds ``token_type_ids``): the refusal's message."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from ds_wallfacer.hf_trainer import WallfacerSFTTrainer
    from ds_wallfacer.hf_trainer.options import UnsupportedTrainerOption

    inner = DataCollatorForVisionLanguageModeling(processor=kwargs["processing_class"])

    def with_token_types(examples: list[dict[str, Any]]) -> dict[str, Any]:
        batch = inner(examples)
        return {**batch, "token_type_ids": torch.zeros_like(batch["input_ids"])}

    try:
        WallfacerSFTTrainer(**{**kwargs, "data_collator": with_token_types})
    except UnsupportedTrainerOption as e:
        return str(e)
    return "not refused"
