"""Start-up self-check: the model as configured against itself without sequence parallelism.

Before any training every rank runs one forward + backward of one short random sequence twice, with the user's
model, dtype and settings: on the full sequence with the model's own attention and loss, and sharded through the
sequence-parallel loss module. The loss and every parameter's gradient must agree within a tolerance set by the
dtype (``tolerances``), or ``initialize`` refuses, naming the parameters that differ most, on every rank.

Design: Note [Start-up self-check] (what runs, tolerances, cost) and Note [Gradient sketches] in docs/design/audit.md.
"""
from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from ..comm import CommLayer
from ..data.chunks import padded_length
from ..data.loader import ShardSpec, prepare_batch
from ..hf_config import text_config
from ..adapters import hf
from ..adapters.mixer_layers import model_forwards
from ..adapters.rope import is_rotary
from .model_audit import RefusedModel, refusal

__all__ = ["SelfCheckReport", "check_length", "run_self_check", "start_up_check", "tolerances"]

log = logging.getLogger("ds_wallfacer")

MAX_TOKENS = 1024
"""The longest sequence "auto" checks (windows and chunks longer than this are covered by the rules alone)."""
_SHOWN = 5


@dataclass(frozen=True)
class SelfCheckReport:
    """What the self-check compared and what it cost."""

    tokens: int
    """Length of the checked sequence."""
    loss: float
    """The reference loss."""
    loss_error: float
    """|loss under sequence parallelism - reference| / |reference|."""
    worst: tuple[tuple[str, float], ...]
    """The parameters whose gradients differ most: (name, relative error), worst first."""
    tolerance: tuple[float, float]
    """(loss, gradient) tolerances that applied."""
    seconds: float
    """Wall time of the check on this rank."""
    held_bytes: int
    """Bytes of one set of gradients (the check holds no second copy), or the device's peak growth on CUDA."""

    @property
    def passed(self) -> bool:
        worst = self.worst[0][1] if self.worst else 0.0
        return self.loss_error <= self.tolerance[0] and worst <= self.tolerance[1]

    def describe(self) -> str:
        worst = ", ".join(f"{n} {e:.1e}" for n, e in self.worst[:3]) or "none"
        return (f"self-check ({self.tokens} tokens): loss {self.loss:.6g}, relative error {self.loss_error:.1e} "
                f"(tolerance {self.tolerance[0]:.0e}); worst gradients {worst} (tolerance {self.tolerance[1]:.0e}); "
                f"{self.seconds:.2f} s, {self.held_bytes / 2**20:.1f} MiB")


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(loss, gradient) relative tolerances. fp32 / fp64: the parity bounds of the tests (loss 1e-5, 1e-3 per
    parameter; correct runs measure ~1e-7 and ~5e-7). bf16 / fp16: every matmul rounds to 8 (11) mantissa bits,
    and the two runs round in different orders: correct runs measured up to 1.6e-2 per gradient (tiny Llama, Mistral,
    Qwen3-MoE; WallFacer C = 2 on 4 ranks), while a local-arange bug measured 0.43-0.52 and the errors this check
    exists for move some gradients by 80-200 %."""
    if dtype in (torch.float32, torch.float64):
        return 1e-5, 1e-3
    return 2e-2, 1e-1


def check_length(text: Any, *, sp_size: int, requested: int | str = "auto") -> int:
    """Tokens of the self-check: ``requested``, else enough to cross the longest window / attention chunk once
    (at most ``MAX_TOKENS``) and at least 16 per rank; rounded up to what the loader pads to."""
    if requested != "auto":
        return padded_length(int(requested), sp_size)
    reach = [int(v) for v in (getattr(text, "sliding_window", None), getattr(text, "attention_chunk_size", None))
             if isinstance(v, int) and not isinstance(v, bool)]
    n = max(64, 16 * sp_size)
    if reach:
        n = max(n, min(MAX_TOKENS, max(reach) + 2 * sp_size))
    return padded_length(n, sp_size)


@contextlib.contextmanager
def _quiet(model: nn.Module) -> Iterator[None]:
    """Dropout off (its masks are per rank), the random streams as they were afterwards."""
    drops = [m for m in model.modules() if isinstance(m, nn.modules.dropout._DropoutNd) and m.training]
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        for m in drops:
            m.eval()
        try:
            yield
        finally:
            for m in drops:
                m.train()


_MODULE_SLOTS = ("_parameters", "_buffers", "_modules")


@contextlib.contextmanager
def _state_kept(model: nn.Module) -> Iterator[None]:
    """Every buffer, and the plain attributes of rotary embeddings, as they were before the check: a dynamic or
    longrope rotary embedding caches the longest length it has seen (``max_seq_len_cached``, ``inv_freq`` updated
    in place), which the check's sequence must not leave behind for training."""
    buffers = [(m, n, b.clone()) for m in model.modules() for n, b in m._buffers.items() if b is not None]
    attrs = [(m, {k: v.clone() if isinstance(v, torch.Tensor) else v
                  for k, v in m.__dict__.items() if k not in _MODULE_SLOTS}) for m in model.modules() if is_rotary(m)]
    try:
        yield
    finally:
        for m, n, b in buffers:
            cur = m._buffers.get(n)
            if cur is not None and cur.shape == b.shape:
                cur.copy_(b)  # in place: the buffer keeps its address (CUDA graphs replay from it)
            else:
                m._buffers[n] = b
        for m, saved in attrs:
            for k in [k for k in m.__dict__ if k not in _MODULE_SLOTS and k not in saved]:
                del m.__dict__[k]
            for k, v in saved.items():
                cur = m.__dict__.get(k)
                if isinstance(cur, torch.Tensor) and isinstance(v, torch.Tensor) and cur.shape == v.shape:
                    cur.copy_(v)
                else:
                    m.__dict__[k] = v


@contextlib.contextmanager
def _reference_attention(model: nn.Module) -> Iterator[None]:
    """The model's own attention and its own forwards of the mixer layers."""
    if not hf.attention_modules(model):  # a pure state-space model
        with model_forwards(model):
            yield
        return
    try:
        hf.set_implementation(model, hf.reference_implementation(model))
    except (ValueError, ImportError):  # e.g. "sdpa" recorded in a config whose model does not take it
        hf.set_implementation(model, "eager")
    try:
        with model_forwards(model):
            yield
    finally:
        hf.set_implementation(model, hf.ATTN_IMPLEMENTATION)


def _take_grads(params: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor | None]:
    out = {}
    for name, p in params:
        out[name], p.grad = p.grad, None
    return out


def _refuse(model: nn.Module, why: str) -> RefusedModel:
    return refusal(model, (
        f" the start-up self-check (one short sequence with and without sequence parallelism) {why}. If a module of "
        'yours is the cause, train it without sequence parallelism; "wallfacer": {"self_check": false} skips this '
        "check at your own risk"))


def run_self_check(
    module: nn.Module,
    *,
    shard: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    group: dist.ProcessGroup,
    comm: CommLayer,
    tokens: int,
) -> SelfCheckReport:
    """Compare ``module`` (the ``SequenceParallelCausalLM`` DeepSpeed will wrap; ``module.lm`` the HF model) with
    the HF model alone on one random sequence of ``tokens``; raise ``RefusedModel`` when they differ. ``shard``:
    full batch -> this rank's batch, as the loader does it. Collective: every rank of ``group`` calls it."""
    lm = module.lm
    params = [(n, p) for n, p in lm.named_parameters() if p.requires_grad]
    if not params:
        raise _refuse(lm, "found no trainable parameters to compare")
    device, dtype = params[0][1].device, params[0][1].dtype
    vocab = int(lm.get_output_embeddings().weight.shape[0]) if lm.get_output_embeddings() is not None else \
        int(getattr(lm.config.get_text_config(), "vocab_size"))
    ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(0x5E1F))
    t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    saved = _take_grads(params)
    try:
        with _quiet(lm), _state_kept(lm):
            batch = _sample(module, ids)
            ref_loss, ref = _reference(lm, batch, device, params)
            sp_loss = _sequence_parallel(module, shard(batch), device, lm)
            errors = _errors(params, ref, group=group, comm=comm, device=comm.device or device)
    finally:
        for name, p in params:
            p.grad = saved[name]
    loss_error = abs(sp_loss - ref_loss) / max(abs(ref_loss), 1e-12)
    # one verdict on every rank: the maximum of every rank's errors
    both = torch.tensor([loss_error, *errors.values()], dtype=torch.float64, device=comm.device or device)
    with comm.phase("self_check"):
        both = comm.all_gather(both, group, kind="check").amax(0).cpu()
    held = sum(p.numel() * p.element_size() for _, p in params)  # one gradient at a time
    if device.type == "cuda":
        held = max(held, torch.cuda.max_memory_allocated(device) - base)
    worst = sorted(zip(errors, both[1:].tolist()), key=lambda x: -x[1])[:_SHOWN]
    report = SelfCheckReport(tokens=tokens, loss=ref_loss, loss_error=float(both[0]), worst=tuple(worst),
                             tolerance=tolerances(dtype), seconds=time.perf_counter() - t0, held_bytes=int(held))
    if not math.isfinite(report.loss) or not report.passed:
        lines = "\n".join(f"    {n}: relative error {e:.3g}" for n, e in report.worst if e > report.tolerance[1])
        raise _refuse(lm, (
            f"found that sequence parallelism changes the result: loss {sp_loss:.7g} vs {ref_loss:.7g} (relative "
            f"error {report.loss_error:.2g}, tolerance {report.tolerance[0]:.0e}); gradients beyond the tolerance "
            f"{report.tolerance[1]:.0e}:\n{lines or '    none'}\n  "
        ))
    return report


def start_up_check(module: nn.Module, *, spec: ShardSpec, group: dist.ProcessGroup, comm: CommLayer,
                   device: torch.device, zero_stage: int, tokens: int | str, pad_token_id: int,
                   ignore_index: int) -> SelfCheckReport:
    """The start-up step: ``run_self_check`` on the device training will use (DeepSpeed would move a ZeRO-0/1/2 model
    there anyway; ZeRO-3 models stay where they are), shards cut as the loader cuts them (``spec``), then its
    traffic forgotten. ``tokens``: ``wallfacer.self_check_tokens``. Rank 0 logs what it measured."""
    lm = module.lm
    if device.type != "cpu" and zero_stage < 3 and any(p.device.type == "cpu" for p in lm.parameters()):
        lm.to(device)

    def shard(batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        return prepare_batch(batch, spec, pad_token_id=pad_token_id, ignore_index=ignore_index, vision=module.vision)

    length = check_length(text_config(lm), sp_size=spec.sp_size, requested=tokens)
    # parameters ZeRO-3 partitioned at construction (zero.Init) are gathered for the check, as a forward would
    partitioned = [p for p in lm.parameters() if hasattr(p, "ds_id")]
    gathered = contextlib.nullcontext()
    if partitioned:
        import deepspeed

        gathered = deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None)
    with gathered:
        report = run_self_check(module, shard=shard, group=group, comm=comm, tokens=length)
    comm.reset()
    module.last_aux_loss = None
    if dist.get_rank() == 0:
        log.warning("ds_wallfacer: %s", report.describe())
    return report


def _sample(module: nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The checked batch: the random tokens; for a vision-language model (``module.vision``, a ``VisionAdapter``),
    with an image inside (the tower, the M-RoPE positions and the feature placement are checked too)."""
    vision = getattr(module, "vision", None)
    return vision.sample(ids) if vision is not None else {"input_ids": ids}


def _reference(lm: nn.Module, batch: Mapping[str, torch.Tensor], device: torch.device,
               params: list[tuple[str, nn.Parameter]]) -> tuple[float, torch.Tensor]:
    batch = {k: v.to(device) for k, v in batch.items()}
    ids = batch["input_ids"]
    if len(batch) == 1:  # text: explicit positions (an image batch lets the model compute its M-RoPE positions)
        batch["position_ids"] = torch.arange(ids.shape[1], device=device)[None]
    with _reference_attention(lm):
        out = lm(**batch, labels=ids, use_cache=False)
        out.loss.backward()
    return out.loss.item(), _sketch_grads(params)


def _sequence_parallel(module: nn.Module, batch: Mapping[str, torch.Tensor], device: torch.device,
                       lm: nn.Module) -> float:
    try:
        loss = module(**{k: v.to(device) for k, v in batch.items()})
        loss.backward()
    except (RefusedModel, RuntimeError, ValueError, NotImplementedError, TypeError) as err:
        raise _refuse(lm, f"could not run the model under sequence parallelism: {type(err).__name__}: {err}") \
            from err
    return loss.item()


SKETCHES = 16
"""Random bilinear sketches kept per parameter (Note [Gradient sketches])."""


def sketch(g: torch.Tensor | None, *, seed: int, k: int = SKETCHES) -> torch.Tensor:
    """Note [Gradient sketches]: [k] fp64 values u_j^T G v_j of the gradient G (a parameter's shape flattened to
    [rows, columns]; None = zeros) with random signs u_j, v_j drawn from ``seed``. Sketches are linear, so the sum
    over ranks of sketches is the sketch of the summed gradient, and mean_j (u_j^T D v_j)^2 is an unbiased
    estimate of ||D||^2 (within ~35 % for k = 16). The self-check keeps k numbers per parameter instead of a
    second copy of every gradient and sums those over ranks instead of the gradients: memory of one training step
    at the check's length, and a few KiB of traffic."""
    if g is None:
        return torch.zeros(k, dtype=torch.float64)
    m = g.detach().reshape(g.shape[0] if g.dim() >= 2 else 1, -1).float()  # [a, b]
    gen = torch.Generator().manual_seed(seed)
    u = torch.randint(0, 2, (k, m.shape[0]), generator=gen).to(m) * 2 - 1  # [k, a]
    v = torch.randint(0, 2, (k, m.shape[1]), generator=gen).to(m) * 2 - 1  # [k, b]
    return ((u @ m) * v).sum(-1).double().cpu()  # [k]


def _sketch_grads(params: list[tuple[str, nn.Parameter]]) -> torch.Tensor:
    """[n_params, k] sketches of the parameters' gradients, which are released."""
    out = torch.stack([sketch(p.grad, seed=i) for i, (_, p) in enumerate(params)])
    for _, p in params:
        p.grad = None
    return out


def _errors(params: list[tuple[str, nn.Parameter]], ref: torch.Tensor, *, group: dist.ProcessGroup,
            comm: CommLayer, device: torch.device) -> dict[str, float]:
    """Per parameter ||mean over ranks of g - g_ref|| / max(||g_ref||, 1e-3 x the largest ||g_ref||), from sketches:
    small gradients are judged against the model's scale, not their own."""
    local = _sketch_grads(params)
    with comm.phase("self_check"):
        # every rank back-propagates P x its share (integration/loss.py): the sum over ranks / P is dL/dtheta
        summed = comm.all_reduce(local.to(device), group, kind="check").cpu() / dist.get_world_size(group)
    norm = ref.pow(2).mean(1).sqrt()  # [n]
    diff = (summed - ref).pow(2).mean(1).sqrt()
    floor = 1e-3 * float(norm.max()) or 1e-30
    return {name: float(diff[i]) / max(float(norm[i]), floor) for i, (name, _) in enumerate(params)}
