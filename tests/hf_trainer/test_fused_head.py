"""The parts of the TRL trainers' sequence parallelism that need no model: rows packed as documents, the replica
view of gathered values, and the refusals raised before TRL or the setup acts."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("trl")

from ds_wallfacer.comm.dims import ParallelDims  # noqa: E402
from ds_wallfacer.hf_trainer.fused_head import aligned_rows, pack_rows  # noqa: E402
from ds_wallfacer.hf_trainer.replicas import ReplicaAccelerator  # noqa: E402


def test_rows_pack_as_documents_with_their_shifted_labels_and_flat_positions() -> None:
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 0, 0, 0], [1, 2, 3, 4, 5]])
    mask = (torch.tensor([[0, 0, 1, 1, 1], [1, 1, 0, 0, 0], [1, 1, 1, 1, 1]])).long()
    labels = ids.masked_fill(mask == 0, -100)
    labels[2, :2] = -100  # a prompt: no target
    full, flat = pack_rows(ids, labels, mask)
    assert full["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 2, 3, 4, 5]]
    assert full["document_lengths"] == [[3, 2, 5]]
    # position t predicts token t + 1 of its own row; each row's last token has no target
    assert full["shift_labels"].tolist() == [[6, 7, -100, 9, -100, -100, 3, 4, 5, -100]]
    assert flat.tolist() == [2, 3, 4, 5, 6, 10, 11, 12, 13, 14]


def test_a_mask_with_a_hole_is_refused() -> None:
    lead, lengths = aligned_rows(torch.tensor([[0, 1, 1, 0]]))
    assert lead.tolist() == [1] and lengths.tolist() == [2]
    with pytest.raises(ValueError, match="hole"):
        aligned_rows(torch.tensor([[1, 0, 1, 1]]))


class _Gathered:
    """What accelerate's gather returns over 4 ranks of 2 replicas x 2 sequence-parallel ranks."""

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        t = t[None] if t.dim() == 0 else t
        return torch.cat([t + 100 * r for r in range(4)])


def test_the_replica_view_keeps_one_rank_per_group_in_replica_order() -> None:
    dims = ParallelDims(world_size=4, sp_size=2)
    view = ReplicaAccelerator(_Gathered(), dims=dims, dp_index=1)
    assert view.num_processes == 2 and view.process_index == 1
    assert view.gather(torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0, 201.0, 202.0]  # ranks 0 and 2
    assert view.gather(torch.tensor(3.0)).tolist() == [3.0, 203.0]
    assert view.reduce(torch.tensor(1.0), "sum").item() == 202.0
    assert view.reduce(torch.tensor([1.0, 2.0]), "mean").tolist() == [101.0, 102.0]


@pytest.mark.parametrize("option", [{"use_vllm": True}])
def test_grpo_refuses_what_would_run_per_rank_before_trl_acts(option: dict) -> None:
    from ds_wallfacer.hf_trainer import UnsupportedTrainerOption, WallfacerGRPOTrainer

    args = type("Args", (), {"use_vllm": option.get("use_vllm", False), "vllm_mode": "colocate",
                             "vllm_tensor_parallel_size": 2})()  # colocated tensor parallelism: refused
    kwargs = {"args": args, **{k: v for k, v in option.items() if k != "use_vllm"}}
    with pytest.raises(UnsupportedTrainerOption, match="not supported under sequence parallelism"):
        WallfacerGRPOTrainer._wf_refuse_arguments(kwargs)


@pytest.mark.parametrize("option", [{"tools": [len]}, {"rollout_func": len}, {"environment_factory": dict}])
def test_custom_rollouts_run_on_grpo_and_are_refused_on_rloo(option: dict) -> None:
    """GRPO takes a rollout_func, tools and environments (``custom_rollouts.py``); TRL's RLOOTrainer takes none."""
    from ds_wallfacer.hf_trainer import UnsupportedTrainerOption, WallfacerGRPOTrainer, WallfacerRLOOTrainer

    kwargs = {"args": type("Args", (), {"use_vllm": False})(), **option}
    WallfacerGRPOTrainer._wf_refuse_arguments(kwargs)
    with pytest.raises(UnsupportedTrainerOption, match=f"{next(iter(option))} is not supported .* RLOOTrainer"):
        WallfacerRLOOTrainer._wf_refuse_arguments(kwargs)
