"""A Trainer checkpoint moved between a sharded (FSDP, Distributed Checkpoint) and an unsharded layout, in one
process: written sharded from a real AdamW's state and gathered back, every tensor comes back bit for bit under its
name and position; an optimizer whose groups or shapes do not fit the model is refused with what does not fit. The
2-rank resumes in both directions are in ``test_fsdp2.py``."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from hf_mixedprec.integrations.sharding import (
    SHARDED_MODEL,
    SHARDED_OPTIMIZER,
    gather_sharded_checkpoint,
    shard_ready_checkpoint,
    sharded_ranks,
)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 12)
        self.norm = nn.LayerNorm(12)
        self.out = nn.Linear(12, 16, bias=False)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight  # tied, as lm_head to the embedding


def _checkpoint(tmp_path):
    """One process's checkpoint of ``_Tied`` after 3 AdamW steps in Trainer's two groups (decay, then no decay)."""
    torch.manual_seed(0)
    model = _Tied()
    named = list(model.named_parameters())
    decay = [n for n, _ in named if n.endswith("weight") and not n.startswith("norm")]
    groups = [[n for n, _ in named if n in decay], [n for n, _ in named if n not in decay]]
    params = dict(named)
    opt = torch.optim.AdamW(
        [{"params": [params[n] for n in g], "weight_decay": wd} for g, wd in zip(groups, (0.1, 0.0))], lr=1e-2
    )
    for _ in range(3):
        x = torch.randint(0, 16, (4,))
        h = model.norm(model.body(model.embed(x)))
        (model.out(h).square().mean() + model.head(model.embed(x)).mean()).backward()
        opt.step()
        opt.zero_grad()
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    state = {k: v for k, v in model.state_dict().items() if k != "head.weight"}  # Trainer drops the tied copy
    save_file(state, folder / "model.safetensors")
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    torch.save({"python": 1}, folder / "rng_state.pth")
    (folder / "trainer_state.json").write_text("{}")
    return model, groups, folder, opt.state_dict()


def test_sharded_and_gathered_back_every_tensor_comes_back_bit_for_bit(tmp_path):
    model, groups, folder, saved = _checkpoint(tmp_path)
    sharded = shard_ready_checkpoint(folder, tmp_path / "sharded", model, groups)
    assert (sharded / SHARDED_MODEL / ".metadata").is_file() and (sharded / SHARDED_OPTIMIZER / ".metadata").is_file()
    assert not (sharded / "model.safetensors").exists() and not (sharded / "optimizer.pt").exists()
    assert (sharded / "rng_state_0.pth").is_file() and (sharded / "trainer_state.json").is_file()
    assert sharded_ranks(sharded) == 1 and sharded_ranks(folder) is None
    back = gather_sharded_checkpoint(sharded, tmp_path / "back", groups)
    weights, original = load_file(back / "model.safetensors"), load_file(folder / "model.safetensors")
    assert torch.equal(weights["head.weight"], weights["embed.weight"])  # the tied name written under both
    assert all(torch.equal(weights[k], v) for k, v in original.items())
    again = torch.load(back / "optimizer.pt", weights_only=True)
    assert [g["params"] for g in again["param_groups"]] == [g["params"] for g in saved["param_groups"]]
    assert [g["weight_decay"] for g in again["param_groups"]] == [0.1, 0.0]
    assert sorted(again["state"]) == sorted(saved["state"])
    for i, st in saved["state"].items():
        for key, value in st.items():
            assert torch.equal(again["state"][i][key], value), (i, key)
    assert (back / "rng_state.pth").is_file() and folder.joinpath("optimizer.pt").is_file()  # the source is kept


def test_an_optimizer_that_does_not_fit_the_model_is_refused_naming_what_does_not(tmp_path):
    model, groups, folder, _ = _checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"groups of \[3, 3\] parameters, this run's has \[2, 4\]"):
        shard_ready_checkpoint(folder, tmp_path / "a", model, [groups[0][:-1], [groups[0][-1], *groups[1]]])
    swapped = [[groups[0][1], groups[0][0], *groups[0][2:]], groups[1]]  # body.weight where embed.weight was
    with pytest.raises(ValueError, match=r"'exp_avg' at position 0 has shape \(16, 8\), this run's parameter there "):
        shard_ready_checkpoint(folder, tmp_path / "b", model, swapped)
    sharded = shard_ready_checkpoint(folder, tmp_path / "c", model, groups)
    with pytest.raises(ValueError, match=r"group 0 holds 'embed.weight' at position 0, this run's 'body.weight'"):
        gather_sharded_checkpoint(sharded, tmp_path / "d", swapped)
    with pytest.raises(ValueError, match=r"groups of \[3, 3\] parameters, this run's has \[2, 4\]"):
        gather_sharded_checkpoint(sharded, tmp_path / "e", [groups[0][:-1], [groups[0][-1], *groups[1]]])
    # an empty group (all norms and biases frozen, or BitFit's decay group) is a group as Trainer keeps it
    assert gather_sharded_checkpoint(sharded, tmp_path / "f", groups).is_dir()


def test_an_empty_parameter_group_is_kept_both_ways(tmp_path):
    """Norms and biases frozen (or BitFit's frozen weights): Trainer still builds both groups, one empty, and
    ``optimizer.state_dict()`` keeps it; the move to the sharded layout and back keeps it too."""
    torch.manual_seed(0)
    model = _Tied()
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith("weight") and not name.startswith("norm"))
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    groups = [[n for n, _ in named], []]
    opt = torch.optim.AdamW([{"params": [p for _, p in named]}, {"params": [], "weight_decay": 0.0}], lr=1e-2)
    model.out(model.norm(model.body(model.embed(torch.arange(4))))).square().mean().backward()
    opt.step()
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    save_file({k: v for k, v in model.state_dict().items() if k != "head.weight"}, folder / "model.safetensors")
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    assert [len(g["params"]) for g in opt.state_dict()["param_groups"]] == [3, 0]
    sharded = shard_ready_checkpoint(folder, tmp_path / "sharded", model, groups)
    back = torch.load(gather_sharded_checkpoint(sharded, tmp_path / "back", groups) / "optimizer.pt", weights_only=True)
    assert [g["params"] for g in back["param_groups"]] == [[0, 1, 2], []]
    assert all(torch.equal(back["state"][i]["exp_avg"], opt.state_dict()["state"][i]["exp_avg"]) for i in range(3))
