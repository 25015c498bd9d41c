"""A user's ``rollout_func``, tools and environments of TRL's GRPO trainer, run by a sequence-parallel group.

The P ranks of a group train on one set of rows (``replicas.py``: TRL sees one process per replica), so whatever
makes the rows must give every rank the same prompt ids, completion ids and tool mask, and must run the user's code
once per prompt where it can. How each part runs:

Note [Custom rollouts and tools in a group].

- ``rollout_func``: each rank calls it on its share of the replica's prompts (``prompt_share``, the split the group's
  own generation uses), with the model's own attention (a KV cache over whole sequences) and rank i's generation
  seed (Note [Seeds of a split rollout]); the group all-gathers the outputs and merges them in the prompts' order
  (``merge_shares``): every list (``prompt_ids``, ``completion_ids``, ``logprobs``, ``env_mask``, which TRL makes the
  tool mask, and any extra field) is the rows' concatenation, any other value (TRL hands it to every row) must be
  the same on every rank. So the function runs once per prompt, and it must return one list item per prompt it is
  given; TRL's processes already get slices whose bounds depend on the process count, so a function that is right
  under TRL treats its rows independently. Inside it the trainer's own ``_generate_single_turn`` generates this
  rank's prompts only (it is not split again). ZeRO-3: a rank with no prompts (fewer prompts than ranks) calls it on
  the first prompt and drops the result, as the group's own generation does, so a function that calls the model a
  fixed number of times per call (one batched ``generate``) enters ZeRO-3's parameter gathers as often as its peers.
  One whose model calls depend on its prompts' number or content would not (a hang): with such a function set
  ``redundant_rollouts``, and every rank runs it on the whole batch, the group keeping its first rank's output.
- Tools and environments: TRL's tool loop runs on every rank over the group's whole batch. The completions are the
  same on every rank, so every rank parses the same tool calls in the same order, and the loop's generation of the
  turns after a tool result (``_generate_single_turn``) is split over the group like any other: each rank enters
  ``generate`` once per turn (ZeRO-3 safe). Environments are stepped on every rank: the group's rewards are its first
  rank's (``replicas.py``), read from that rank's environments, and every rank stays a copy of one TRL process.
  Async tools run on every rank too: TRL runs a row's coroutines at once on its event loop, so a collective inside
  them would have no fixed order across ranks. Plain (sync) standalone tools run once, on the group's first rank,
  which sends every rank the result (``SharedTool``: one object all-gather per call, in the loop's order, the same on
  every rank): the first rank sees every call as one process would (side effects that a reward function reads
  included) and a tool that asks the outside world (a search, a clock, a sandbox) gives the group one answer. A
  tool's exception reaches TRL's loop on every rank with the tool's message (TRL counts it as a failed call).
- After a rollout the group compares a digest of its rows (``check_same_rows``: prompt ids, completion ids, tool
  mask, log-probabilities) and raises ``RolloutMismatch`` naming the environments and tools if a rank holds other
  rows than the first (an environment or async tool that answers differently per rank would otherwise train
  different rows on each rank, silently). Then the group takes its first rank's random state again (``rl.py``), so
  that code which drew random numbers on one rank only cannot change the shuffle that cuts the round into
  micro-batches.
"""
from __future__ import annotations

import hashlib
import inspect
import pickle
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ..adapters.hf import model_attention
from ..comm.ops import CommLayer
from .rollouts import generation_seed, prompt_share, seeded_generation

__all__ = ["GroupRolloutFunc", "RolloutMismatch", "SharedTool", "SharedToolError", "check_same_rows",
           "merge_shares", "rollout_share", "rows_digest", "share_sync_tools"]

ROW_KEYS = ("prompt_ids", "completion_ids", "logprobs")
"""The keys TRL requires of a ``rollout_func``'s output: one item per prompt each (``logprobs`` may be None)."""


class RolloutMismatch(RuntimeError):
    """The ranks of a sequence-parallel group did not make the same rows (Note [Custom rollouts and tools in a
    group])."""


class SharedToolError(Exception):
    """A standalone tool's exception on the group's first rank, raised on every rank with its message (TRL's tool
    loop records ``{"error": str(e)}``)."""


# -- rollout_func ----------------------------------------------------------------------------------------------
def rollout_share(output: Any, *, rows: int, keep: int) -> dict[str, dict[str, Any]]:
    """A ``rollout_func``'s output for ``rows`` prompts -> ``{"rows": per-prompt lists cut to the first keep,
    "shared": every other value}``; refuses a list of another length (it would not line up with the prompts)."""
    if not isinstance(output, dict):
        raise TypeError(f"rollout_func returned a {type(output).__name__}; TRL needs a dict with keys {list(ROW_KEYS)}")
    missing = [k for k in ROW_KEYS if k not in output]
    if missing:
        raise ValueError(f"rollout_func must return keys {missing} in its output dict")
    per_row: dict[str, list] = {}
    shared: dict[str, Any] = {}
    for key, value in output.items():
        if key in ROW_KEYS and value is not None and not isinstance(value, list):
            value = list(value)  # a tensor or tuple of rows: TRL iterates it row by row
        if not isinstance(value, list):
            shared[key] = value
        elif len(value) != rows:
            raise ValueError(
                f"rollout_func returned {len(value)} items in {key!r} for {rows} prompts: under sequence parallelism "
                "each rank calls it on its share of the prompts, so every list it returns must hold one item per "
                "prompt it was given (a value for the whole batch must not be a list)"
            )
        else:
            per_row[key] = value[:keep]
    return {"rows": per_row, "shared": shared}


def merge_shares(shares: Sequence[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The group's ``rollout_share``s, in group-rank order (the prompts' order) -> one output: the lists
    concatenated, the other values as they are (they must be the same on every rank)."""
    first = shares[0]
    for index, share in enumerate(shares[1:], 1):
        if set(share["rows"]) != set(first["rows"]) or set(share["shared"]) != set(first["shared"]):
            raise ValueError(f"rollout_func returned keys {sorted(share['rows']) + sorted(share['shared'])} on rank "
                             f"{index} of the group and {sorted(first['rows']) + sorted(first['shared'])} on its first")
        for key, value in share["shared"].items():
            if pickle.dumps(value) != pickle.dumps(first["shared"][key]):
                raise ValueError(
                    f"rollout_func returned another {key!r} on rank {index} of the group than on its first: a value "
                    "that is not a list is given to every row, so the ranks' calls on their shares must agree on it; "
                    "return a list with one item per prompt instead"
                )
    out: dict[str, Any] = dict(first["shared"])
    for key in first["rows"]:
        out[key] = [item for share in shares for item in share["rows"][key]]
    return out


class GroupRolloutFunc:
    """The user's ``rollout_func`` as the trainer's ``rollout_func``: called as TRL calls it, ``(prompts,
    trainer)``, on every rank of the group; returns the group's merged output (Note [Custom rollouts and tools in a
    group])."""

    def __init__(self, func: Callable[[list, Any], dict]) -> None:
        self.func = func

    def __call__(self, prompts: list, trainer: Any) -> dict[str, Any]:
        t0, sp = time.perf_counter(), trainer.sequence_parallel
        parts, index = sp.setup.dims.sp_size, sp.groups.sp_index
        redundant = trainer.redundant_rollouts
        start, stop = (0, len(prompts)) if redundant else prompt_share(len(prompts), parts=parts, index=index)
        mine = prompts[start:stop] or prompts[:1]  # no prompts: the first one, dropped (ZeRO-3, see the Note)
        output = self._call(mine, trainer, seed=None if redundant else generation_seed(
            torch.random.get_rng_state(), index=index))
        share = rollout_share(output, rows=len(mine), keep=stop - start)
        with sp.comm.phase("data"):
            shares = sp.comm.all_gather_object(share, sp.groups.sp_group)
        merged = merge_shares(shares[:1] if redundant else shares)
        trainer._wf_count_rollout(output["completion_ids"], merged["completion_ids"], prompts=stop - start,
                                  seconds=time.perf_counter() - t0)
        return merged

    def _call(self, prompts: list, trainer: Any, *, seed: int | None) -> Any:
        """The user's function on ``prompts`` with the model's own attention; its generation local to this rank;
        sampling from ``seed`` (None: the global generators, as the redundant baseline generates)."""
        trainer._wf_local_rollout = True
        try:
            with model_attention(trainer.model):
                if seed is None:
                    return self.func(prompts, trainer)
                with seeded_generation(seed, device=trainer.sequence_parallel.comm.device):
                    return self.func(prompts, trainer)
        finally:
            trainer._wf_local_rollout = False


# -- tools -----------------------------------------------------------------------------------------------------
class SharedTool:
    """A plain (sync) standalone tool of TRL's tool loop for one row: the group's first rank calls it, every rank
    returns its result (or raises its exception's message). ``faults`` collects what went wrong in the exchange
    itself: TRL's loop catches every exception a tool raises, so the trainer raises these after the loop."""

    def __init__(self, tool: Callable[..., Any], *, row: int, comm: CommLayer, group: dist.ProcessGroup,
                 first: bool, faults: list[str]) -> None:
        self.tool, self.row, self.comm, self.group, self.first, self.faults = tool, row, comm, group, first, faults
        self.__name__ = getattr(tool, "__name__", type(tool).__name__)

    def __call__(self, **arguments: Any) -> Any:
        key = (self.row, self.__name__, hashlib.sha256(repr(sorted(arguments.items())).encode()).hexdigest())
        answer = self._run(arguments) if self.first else None
        try:
            with self.comm.phase("data"):
                every = self.comm.all_gather_object((key, answer), self.group)
        except Exception as e:
            self.faults.append(f"tool {self.__name__!r} (row {self.row}): the group's exchange of its result failed: "
                               f"{e}")
            raise
        if any(k != key for k, _ in every):
            self.faults.append(f"tool {self.__name__!r}: the ranks of the group reached different tool calls "
                               f"({sorted({k for k, _ in every})}); their completions differ")
            raise RolloutMismatch(self.faults[-1])
        kind, value = every[0][1]
        if kind == "error":
            raise SharedToolError(value)
        if kind == "fault":
            self.faults.append(value)
            raise RolloutMismatch(value)
        return value

    def _run(self, arguments: dict[str, Any]) -> tuple[str, Any]:
        """("ok", what TRL makes of the result: a list as it is, anything else as its text), ("error", the
        exception's message) or ("fault", why the result cannot be sent)."""
        try:
            result = self.tool(**arguments)
        except Exception as e:  # TRL's loop turns a tool's exception into {"error": str(e)}
            return "error", str(e)
        value = result if isinstance(result, list) else str(result)
        try:
            pickle.dumps(value)
        except Exception as e:
            return "fault", (f"tool {self.__name__!r} returned a list the group's first rank cannot send to the "
                             f"other ranks ({e}); return text or picklable content blocks")
        return "ok", value


def share_sync_tools(trainer: Any, faults: list[str]) -> None:
    """Wrap the plain standalone tools in the per-row tool tables TRL built for this batch (``_sync_tool_dicts``) in
    ``SharedTool``s; environment methods and async tools stay as they are (they run on every rank)."""
    standalone = [t for t in getattr(trainer, "_standalone_tools", None) or []
                  if not inspect.iscoroutinefunction(t)]
    if not standalone:
        return
    sp = trainer.sequence_parallel
    for row, table in enumerate(trainer._sync_tool_dicts):
        for name, tool in table.items():
            if any(tool is t for t in standalone):
                table[name] = SharedTool(tool, row=row, comm=sp.comm, group=sp.groups.sp_group,
                                         first=sp.groups.sp_index == 0, faults=faults)


# -- the group's check -----------------------------------------------------------------------------------------
def rows_digest(*fields: Any) -> torch.Tensor:
    """A SHA-256 digest of picklable ``fields`` (the rows of a rollout) as 4 int64 numbers."""
    return torch.frombuffer(bytearray(hashlib.sha256(pickle.dumps(fields)).digest()), dtype=torch.int64).clone()


def check_same_rows(fields: Sequence[Any], *, comm: CommLayer, group: dist.ProcessGroup, sources: str,
                    trainer: str) -> None:
    """Raise ``RolloutMismatch`` unless every rank of ``group`` holds the same ``fields`` (collective); ``sources``
    names what ran per rank (the environments and async tools), ``trainer`` the trainer, for the message."""
    with comm.phase("data"):
        every = comm.all_gather(comm.place(rows_digest(*fields)), group).cpu()  # [4] -> [P, 4]
    differ = [r for r in range(1, every.shape[0]) if not torch.equal(every[r], every[0])]
    if differ:
        raise RolloutMismatch(
            f"{trainer}: after a rollout, ranks {differ} of the sequence-parallel group hold other rows (prompt ids, "
            f"completion ids, tool mask or log-probabilities) than its first rank. {sources} run on every rank of "
            "the group and must give the same results there: make them deterministic given their arguments and the "
            "random state (TRL seeds every rank of a replica alike); a plain (sync) standalone tool runs once, on "
            "the group's first rank, and may answer anything"
        )
