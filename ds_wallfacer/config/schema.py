"""The ``"wallfacer"`` section of a ds_config JSON, parsed ONCE into frozen dataclasses.

Everything else in the package reads these dataclasses, never the raw dict. Pure Python: no torch import.

Example (every key optional; the defaults are the dataclass defaults below)::

    "wallfacer": {
        "sequence_parallel_size": 4,
        "mode": "hybrid",
        "ulysses_degree": 2,
        "ring_count": "auto",
        "sharding": "zigzag",
        "kernel": "auto",
        "cluster": "auto",
        "seq_len": 131072,
        "mini_sequence": {"mlp": true, "lm_head": true}
    }

"auto" sizes, mode and placement are chosen at start-up by the topology planner (``ds_wallfacer.planner``) for the
cluster, the model and ``seq_len`` (``planner.auto.resolve_auto``); this package only parses and validates.
"""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Union

from .._sections import section_kwargs
from ..attention.kernel_names import KERNEL_NAMES
from ..comm.dims import MODES, PLACEMENTS, Mode, check_mode
from ..data.chunks import SHARDINGS
from .alst import apply_alst_keys

__all__ = ["MODES", "PLACEMENTS", "SHARDINGS", "DynamicSequenceParallelConfig", "RunConfig", "WallFacerConfig",
           "parse_ds_config"]

AutoInt = Union[int, Literal["auto"]]


def _is_pos_int(v: Any) -> bool:
    # bool is an int subclass; ``true`` as a size is a mistake, not 1
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _check_auto_int(key: str, value: Any) -> None:
    if value != "auto" and not _is_pos_int(value):
        raise ValueError(f'wallfacer.{key} = {value!r} is invalid: allowed is a positive integer or "auto"')


def _check_choice(key: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"wallfacer.{key} = {value!r} is invalid: allowed are {', '.join(map(repr, choices))}")


@dataclass(frozen=True)
class WallFacerConfig:
    """The ``"wallfacer"`` section: how sequences are split and how attention crosses ranks."""

    sequence_parallel_size: AutoInt = "auto"
    """P: ranks that share one sequence; "auto" = the whole world (no data parallelism beside it)."""
    mode: Mode | Literal["auto"] = Mode.WALLFACER
    """Attention across ranks (``comm.dims.Mode``; the word is parsed to it): WallFacer multi-ring, DeepSpeed-style
    Ulysses all-to-all, Ulysses inside WallFacer (hybrid), or "auto" (the planner picks; "wallfacer" when it cannot
    plan; ``fixed_mode`` is None)."""
    ring_count: AutoInt = "auto"
    """C: WallFacer ring count (team size); C*C must divide the ring dimension P/U. "auto" = chosen at start-up."""
    ulysses_degree: AutoInt = "auto"
    """U: Ulysses all-to-all degree over consecutive ranks; must divide the query heads and divide (or be a
    multiple of) the kv heads. "auto": 1 for wallfacer, P for ulysses, chosen for hybrid."""
    sharding: Literal["zigzag", "contiguous", "balanced"] = "zigzag"
    """Load balancing of the ring dimension: zigzag (balanced causal work), contiguous chunks, or balanced
    (packed documents: more, smaller chunks assigned by attention work per batch; zigzag without documents)."""
    balance_steps: bool = False
    """Data-parallel replicas: each round of micro-batches takes rows of near-equal attention work (their documents'
    squares; ``data/steps.py``). Read by ``SequenceParallel.dataloader`` (map-style datasets), the trainer (as
    ``--balance_steps``) and ``WallfacerTrainer``."""
    kernel: str = "auto"
    """Block-attention kernel backend (``ds_wallfacer.attention.KERNELS``) or "auto" (by device and dtype)."""
    ulysses_head_groups: int = 2
    """K: Ulysses alone computes the heads it receives in K groups, each group's all-to-all in flight while another
    computes (same results and bytes; 1: one all-to-all each way). Used when K divides the query and kv heads each
    rank holds after the all-to-all."""
    ranks_per_node: AutoInt = "auto"
    """Ranks per node, for keeping teams / Ulysses groups inside a node; "auto" = LOCAL_WORLD_SIZE (torchrun) or
    LOCAL_SIZE (the deepspeed launcher)."""
    placement: Literal["auto", "team-inner", "ring-inner"] = "auto"
    """Ring ranks on consecutive global ranks: teams ("team-inner") or sub-rings ("ring-inner"); "auto" = planner."""
    cluster: str = "auto"
    """Planner hardware figures: a ``planner.CLUSTERS`` preset, or "auto" (cpu / h200x1 / a100x32-eth / h100x64 by
    the accelerator); ranks and ranks per node always come from the launch environment."""
    seq_len: int | None = None
    """Tokens per training sequence that "auto" is planned for; null = ``initialize(seq_len=)``, else unknown (then
    "auto" follows the safe rule)."""
    mini_sequence: Any = None
    """Mini-Sequence Transformer settings (``ds_wallfacer.mst.MiniSequenceConfig``); absent/null = MsT off,
    ``{}`` = MsT on with its defaults."""
    self_check: bool = True
    """At start-up, one forward + backward of a short random sequence with the model as configured, against the same
    model on the full sequence without sequence parallelism; a loss or gradient that differs is refused
    (``audit/self_check.py``). false skips it."""
    self_check_tokens: AutoInt = "auto"
    """Tokens of the self-check's sequence; "auto" = enough to cross the model's windows and chunks, at most 1024."""
    allow_modules: tuple[str, ...] = ()
    """Class names the deny-by-default rules would refuse that you have checked yourself (e.g. a position-wise
    module of your own whose code calls ``torch.arange``); the self-check still compares them."""
    dynamic_sequence_parallel: Any = None
    """Dynamic sequence parallelism (``DynamicSequenceParallelConfig``): each row of a step runs on a group of the
    size it needs (1, the powers of two dividing P, P), many groups at once; absent/null = every row on P ranks,
    ``{}`` = on with its defaults."""
    collective_timeout_s: float = 600.0
    """Seconds a collective may wait for a peer before it fails: torch.distributed's world group, DeepSpeed's own
    groups and ours (torch's default, 30 min for gloo, would otherwise apply to DeepSpeed's)."""

    def __post_init__(self) -> None:
        if self.sequence_parallel_size != "auto" and not _is_pos_int(self.sequence_parallel_size):
            raise ValueError(
                f'wallfacer.sequence_parallel_size = {self.sequence_parallel_size!r} is invalid: allowed is a '
                f'positive integer or "auto"'
            )
        _check_auto_int("ring_count", self.ring_count)
        _check_auto_int("ulysses_degree", self.ulysses_degree)
        _check_auto_int("ranks_per_node", self.ranks_per_node)
        _check_choice("sharding", self.sharding, SHARDINGS)
        _check_choice("placement", self.placement, ("auto", *PLACEMENTS))
        if not isinstance(self.cluster, str) or not self.cluster:
            raise ValueError(
                f'wallfacer.cluster = {self.cluster!r} is invalid: allowed is a cluster preset name or "auto"'
            )
        t = self.collective_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise ValueError(
                f"wallfacer.collective_timeout_s = {t!r} is invalid: allowed is a positive number of seconds"
            )
        if self.seq_len is not None and not _is_pos_int(self.seq_len):
            raise ValueError(f"wallfacer.seq_len = {self.seq_len!r} is invalid: allowed is a positive integer or null")
        _check_choice("kernel", self.kernel, ("auto", *KERNEL_NAMES))
        if not _is_pos_int(self.ulysses_head_groups):
            raise ValueError(f"wallfacer.ulysses_head_groups = {self.ulysses_head_groups!r} is invalid: allowed is a "
                             "positive integer (1: no overlap)")
        if not isinstance(self.balance_steps, bool):
            raise ValueError(f"wallfacer.balance_steps = {self.balance_steps!r} is invalid: allowed are true and false")
        if not isinstance(self.self_check, bool):
            raise ValueError(f"wallfacer.self_check = {self.self_check!r} is invalid: allowed are true and false")
        _check_auto_int("self_check_tokens", self.self_check_tokens)
        if not isinstance(self.allow_modules, tuple) or not all(isinstance(c, str) and c for c in self.allow_modules):
            raise ValueError(f"wallfacer.allow_modules = {list(self.allow_modules)!r} is invalid: allowed is a list "
                             "of module class names")
        if self.dynamic_sequence_parallel is not None and self.balance_steps:
            raise ValueError("wallfacer.dynamic_sequence_parallel schedules every step's rows by their work itself: "
                             "drop wallfacer.balance_steps")
        if self.mode != "auto":
            object.__setattr__(self, "mode", Mode.parse(self.mode))
            check_mode(self.mode, ulysses_degree=self.ulysses_degree, ring_count=self.ring_count,
                       sp_size=self.sequence_parallel_size)

    @property
    def fixed_mode(self) -> Mode | None:
        """The mode the user set; None for "auto" (the one place that reads the config's extra word)."""
        return None if self.mode == "auto" else self.mode

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "WallFacerConfig":
        """Parse and validate the section (None or {} gives the defaults). Unknown keys are an error."""
        if d is None:
            return cls()
        kwargs = section_kwargs(cls, d, name="wallfacer")
        if isinstance(kwargs.get("allow_modules"), list):
            kwargs["allow_modules"] = tuple(kwargs["allow_modules"])
        if kwargs.get("dynamic_sequence_parallel") is not None:
            kwargs["dynamic_sequence_parallel"] = DynamicSequenceParallelConfig.from_dict(
                kwargs["dynamic_sequence_parallel"])
        if "mini_sequence" in kwargs and kwargs["mini_sequence"] is not None:
            kwargs["mini_sequence"] = _parse_mini_sequence(kwargs["mini_sequence"])
        return cls(**kwargs)


@dataclass(frozen=True)
class DynamicSequenceParallelConfig:
    """The ``wallfacer.dynamic_sequence_parallel`` section: how rows choose their group size
    (``planner/dynamic.py``)."""

    max_tokens_per_rank: AutoInt = "auto"
    """A row fits a group when each rank holds at most this many of its tokens; "auto": when the planner's memory
    model says it fits the device (``wallfacer.cluster``)."""

    def __post_init__(self) -> None:
        _check_auto_int("dynamic_sequence_parallel.max_tokens_per_rank", self.max_tokens_per_rank)

    @classmethod
    def from_dict(cls, d: Any) -> "DynamicSequenceParallelConfig":
        return cls(**section_kwargs(cls, d, name="wallfacer.dynamic_sequence_parallel"))


def _parse_mini_sequence(d: Any) -> Any:
    """The ``mini_sequence`` sub-dict belongs to the MsT component: its own dataclass parses it."""
    from ..mst.config import MiniSequenceConfig  # pure module (no torch import)

    return MiniSequenceConfig.from_dict(d)


@dataclass(frozen=True)
class RunConfig:
    """A whole ds_config: our section parsed, plus what DeepSpeed gets and the batch sizes we need."""

    wallfacer: WallFacerConfig
    """The parsed ``"wallfacer"`` section."""
    deepspeed: dict = field(repr=False)
    """The ds_config without the ``"wallfacer"`` key (a private copy; ``deepspeed_dict`` hands out copies)."""
    micro_batch_size: int | None = None
    """``train_micro_batch_size_per_gpu``: sequences per step per sequence-parallel group (None: derived)."""
    gradient_accumulation_steps: int = 1
    """``gradient_accumulation_steps`` (default 1)."""
    train_batch_size: int | None = None
    """``train_batch_size`` as the user wrote it: sequences per optimizer step over all data-parallel replicas."""

    @property
    def zero_stage(self) -> int:
        """``zero_optimization.stage`` (DeepSpeed's default 0)."""
        return int((self.deepspeed.get("zero_optimization") or {}).get("stage", 0))

    @property
    def offload_optimizer(self) -> bool:
        """ZeRO optimizer state offloaded to the CPU (``zero_optimization.offload_optimizer.device``)."""
        off = (self.deepspeed.get("zero_optimization") or {}).get("offload_optimizer") or {}
        return off.get("device", "none") in ("cpu", "nvme")

    @property
    def offload_params(self) -> bool:
        """ZeRO-3 parameters offloaded to the CPU (``zero_optimization.offload_param.device``)."""
        off = (self.deepspeed.get("zero_optimization") or {}).get("offload_param") or {}
        return off.get("device", "none") in ("cpu", "nvme") and self.zero_stage == 3

    @property
    def cpu_checkpointing(self) -> bool:
        """Checkpointed activations kept on the CPU (``activation_checkpointing.cpu_checkpointing``)."""
        return bool((self.deepspeed.get("activation_checkpointing") or {}).get("cpu_checkpointing", False))

    @property
    def elem_bytes(self) -> int:
        """Bytes per weight / activation element: 2 with bf16 or fp16 enabled, else 4 (fp32)."""
        half = any((self.deepspeed.get(k) or {}).get("enabled", False) for k in ("bf16", "fp16", "bfloat16"))
        return 2 if half else 4

    @property
    def has_optimizer(self) -> bool:
        """Whether the ds_config names an optimizer (else the caller must pass one to ``initialize``)."""
        return bool(self.deepspeed.get("optimizer"))

    def micro_batch(self, *, dp_size: int) -> int:
        """Sequences per micro-step per sequence-parallel group (DeepSpeed's rule when only the total is given)."""
        if self.micro_batch_size is not None:
            return self.micro_batch_size
        if self.train_batch_size is None:
            return 1
        per = self.gradient_accumulation_steps * dp_size
        if self.train_batch_size % per:
            raise ValueError(
                f"train_batch_size = {self.train_batch_size} is not divisible by gradient_accumulation_steps "
                f"({self.gradient_accumulation_steps}) x data-parallel size ({dp_size})"
            )
        return self.train_batch_size // per

    def deepspeed_dict(self, *, world_size: int, sp_size: int) -> dict:
        """The dict for ``deepspeed.initialize``. DeepSpeed sees every rank as a data-parallel replica (see
        ``integration/deepspeed.py``), so a user's ``train_batch_size`` (sequences) is checked against the
        data-parallel size and multiplied by P for DeepSpeed's own arithmetic."""
        d = copy.deepcopy(self.deepspeed)
        dp = world_size // sp_size
        micro = self.micro_batch(dp_size=dp)
        want = micro * self.gradient_accumulation_steps * dp
        if self.train_batch_size is not None and self.train_batch_size != want:
            raise ValueError(
                f"train_batch_size = {self.train_batch_size} must equal train_micro_batch_size_per_gpu "
                f"({micro}) x gradient_accumulation_steps ({self.gradient_accumulation_steps}) x "
                f"data-parallel size ({dp} = {world_size} ranks / sequence_parallel_size {sp_size}) = {want}: the "
                f"{sp_size} ranks of a sequence-parallel group share each sequence"
            )
        d["train_micro_batch_size_per_gpu"] = micro
        d["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        d["train_batch_size"] = want * sp_size
        if self.wallfacer.dynamic_sequence_parallel is not None:  # a step has as many rounds as its rows need
            d["managed_gradient_accumulation"] = False
        return d


def _batch_int(ds: Mapping[str, Any], key: str) -> int | None:
    v = ds.get(key)
    if v is None or v == "auto":
        return None
    if not _is_pos_int(v):
        raise ValueError(f"ds_config {key} = {v!r} is invalid: allowed is a positive integer")
    return v


def parse_ds_config(config: str | os.PathLike | Mapping[str, Any]) -> RunConfig:
    """Read a ds_config (path to JSON, or dict) and parse its ``"wallfacer"`` section, DeepSpeed's own
    sequence-parallel keys included (``alst.py``). Pure; deterministic, so every rank raises the same error at
    start-up."""
    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.is_file():
            raise FileNotFoundError(f"ds_config file {str(path)!r} does not exist")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"ds_config file {str(path)!r} is not valid JSON: {e}") from None
    elif isinstance(config, Mapping):
        raw = copy.deepcopy(dict(config))
    else:
        raise TypeError(f"config must be a path to a ds_config JSON or a dict, got {type(config).__name__}")
    if not isinstance(raw, dict):
        raise ValueError(f"a ds_config must be a JSON object, got {type(raw).__name__}")
    apply_alst_keys(raw)
    wf = WallFacerConfig.from_dict(raw.pop("wallfacer", None))
    return RunConfig(
        wallfacer=wf,
        deepspeed=raw,
        micro_batch_size=_batch_int(raw, "train_micro_batch_size_per_gpu"),
        gradient_accumulation_steps=_batch_int(raw, "gradient_accumulation_steps") or 1,
        train_batch_size=_batch_int(raw, "train_batch_size"),
    )
