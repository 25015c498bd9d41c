"""DeepSpeed's own ALST baseline of ``benchmarks/bench_train.py``: Ulysses sequence parallelism for HF models
(``UlyssesSPAttentionHF`` + ``UlyssesSPDataLoaderAdapter``, deepspeed.runtime.sequence_parallel.ulysses_sp) with the
loss weighting of its tutorial, and, with ``spec["tiled"]``, its tiling: ``TiledMLP`` per MLP (ceil(S / d) shards),
``TiledFusedLogitsLoss`` for the head, HF activation checkpointing (non-reentrant).

Runs inside a ``deepspeed`` launcher rank; ``bench_train.worker`` times the returned ``step``.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["AlstCounter", "alst_job"]


class AlstCounter:
    """Bytes ALST's Ulysses all-to-alls send from this rank, by phase (wraps ``deepspeed.comm.all_to_all_single``)."""

    def __init__(self) -> None:
        import deepspeed.comm as ds_comm

        self.phase, self.sent, self._orig = "forward", {}, ds_comm.all_to_all_single

        def counted(output, tensor, *a, group=None, **kw):
            n = ds_comm.get_world_size(group)
            key = (self.phase, "all_to_all")
            self.sent[key] = self.sent.get(key, 0) + (n - 1) * tensor.numel() * tensor.element_size() // n
            return self._orig(output, tensor, *a, group=group, **kw)

        ds_comm.all_to_all_single = counted

    def reset(self) -> None:
        self.sent = {}


def _alst_model(spec: dict, build_model: Callable[[str], Any]) -> tuple[Any, Any]:
    """(model, mpu): the model on ALST's Ulysses attention; ``tiled``: TiledMLP per MLP and HF checkpointing."""
    import math

    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF

    model = build_model("sdpa")
    mpu = UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model, core_attn_implementation="sdpa", sequence_parallel_size=spec["ranks"],
        micro_batch_size=1, seq_length_is_variable=True)
    if spec["tiled"]:
        def tiled_mlp(mlp, x):
            fn = lambda m, h: type(m).forward(m, h)  # noqa: E731
            return TiledMLP.apply(fn, mlp, x, math.ceil(x.shape[-2] / x.shape[-1]), list(mlp.parameters()))

        for layer in model.model.layers:
            layer.mlp.forward = tiled_mlp.__get__(layer.mlp)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, mpu


def _alst_batches(ids: list, mpu: Any, device: Any) -> list[dict]:
    """This rank's batches as ALST's loader adapter serves them; the tiny first batch by hand (the adapter gathers
    one batch from each rank, and gloo needs equal lengths): contiguous shards, labels shifted before sharding,
    global positions, as the adapter does."""
    import torch
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter

    group, rank, p = mpu.get_sequence_parallel_group(), mpu.get_sequence_parallel_rank(), \
        mpu.get_sequence_parallel_world_size()
    tiny, n = ids[0], ids[0].shape[1] // p
    shift = F.pad(tiny[:, 1:], (0, 1), value=-100)
    shards = [{"input_ids": tiny[:, rank * n:(rank + 1) * n], "shift_labels": shift[:, rank * n:(rank + 1) * n],
               "position_ids": torch.arange(rank * n, (rank + 1) * n).view(1, n)}]
    full = ids[1:] + ids[1:][: -len(ids[1:]) % p]  # every rank's loader the same length
    mine = [{"input_ids": x[0], "labels": x[0].clone(), "position_ids": torch.arange(x.shape[1])}
            for x in full[rank::p]]  # rank r's loader holds batches r, r + P, ...: the adapter serves them in order
    adapter = UlyssesSPDataLoaderAdapter(torch.utils.data.DataLoader(mine, batch_size=1), sp_rank=rank,
                                         sp_group=group, sp_world_size=p, device=device)
    return shards + list(adapter)


def alst_job(spec: dict, ids: list, *, build_model: Callable[[str], Any], ds_config: dict, vocab: int):
    """(engine, step, counter) for DeepSpeed ALST: UlyssesSPAttentionHF + UlyssesSPDataLoaderAdapter, the loss
    weighting of its tutorial; ``tiled``: TiledMLP per MLP, TiledFusedLogitsLoss, HF activation checkpointing."""
    import math

    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
    )

    from ds_wallfacer.integration.ds_runtime import release_shm_buffer

    deepspeed.init_distributed()
    dist.barrier()
    release_shm_buffer()  # DeepSpeed's CPU all-reduce segments: unlinked once every rank mapped them
    p = spec["ranks"]
    model, mpu = _alst_model(spec, build_model)

    class Local(torch.nn.Module):  # this rank's token-mean loss (what ALST's tutorial aggregates)
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, input_ids, position_ids, shift_labels):
            if not spec["tiled"]:
                logits = self.lm(input_ids=input_ids, position_ids=position_ids).logits
                return F.cross_entropy(logits.float().view(-1, vocab), shift_labels.view(-1), ignore_index=-100)
            hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids).last_hidden_state

            # TiledFusedLogitsLoss adds the head weight's gradient inside its forward, for an incoming gradient of
            # 1: what it returns must be this rank's share of the global token mean, back-propagated unscaled
            count = (shift_labels != -100).sum()
            dist.all_reduce(count, group=mpu.get_sequence_parallel_group())
            norm = 1.0 / float(max(int(count), 1))

            def loss_fn(head, x, y):
                logits = head(x).float().view(-1, vocab)
                return F.cross_entropy(logits, y.view(-1), ignore_index=-100, reduction="sum") * norm

            shards = max(1, math.ceil(hidden.shape[1] * vocab * 4 / (spec["logits_mib"] << 20)))
            return TiledFusedLogitsLoss.apply(loss_fn, self.lm.lm_head, hidden, shift_labels, None, shards,
                                              [self.lm.lm_head.weight], "sum")

    module = Local(model)
    opt = torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0)
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=ds_config, mpu=mpu)
    group = mpu.get_sequence_parallel_group()
    shards = _alst_batches(ids, mpu, engine.device)
    counter = AlstCounter()

    def step(i: int) -> Any:
        b = {k: shards[i][k].to(engine.device) for k in ("input_ids", "position_ids", "shift_labels")}
        counter.phase = "forward"
        loss = engine(**b)
        if spec["tiled"]:  # this rank's share of the global mean, back-propagated as it is (see Local)
            counter.phase = "backward"
            engine.backward(loss)
            engine.step()
            total = loss.detach().clone()
            dist.all_reduce(total, group=group)
            return total
        # the tutorial's differentiable weighting of the ranks' token means
        good = (b["shift_labels"] != -100).sum()
        losses = torch.distributed.nn.functional.all_gather(loss, group=group)
        goods = torch.distributed.nn.functional.all_gather(good, group=group)
        total = sum(losses[r] * goods[r] for r in range(p) if goods[r] > 0) / max(sum(goods), 1)
        counter.phase = "backward"
        engine.backward(total)
        engine.step()
        return total.detach()

    return engine, step, counter, f"ALST Ulysses U={p}{' + TiledMLP + TiledFusedLogitsLoss + ckpt' if spec['tiled'] else ''}"
