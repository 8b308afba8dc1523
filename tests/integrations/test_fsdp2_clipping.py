"""Adaptive clipping on FSDP2-sharded gradients: two gloo ranks, each holding half of every gradient (``fully_shard``),
clip as one process does on the same global batch, with one all-reduce per clip and nothing gathered. The ranks run
:func:`sharded_clipping` in tests/integrations/test_fsdp2_ranks.py's shared processes, whose tests check it with the
functions here."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hf_mixedprec.core.demo import tiny_llama
from hf_mixedprec.training.clipping import make_clipper

METHODS = {
    "norm": {"max_norm": 0.5},
    "zclip": {"warmup_steps": 2},
    "autoclip": {"percentile": 50.0},
    "agc": {"clip_factor": 0.01},
}
STEPS = 6
BATCH = 4  # the global batch; each of the 2 ranks takes half


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 100, (BATCH, 16), generator=g) for _ in range(STEPS)]


def _train(method: str, rank: int | None, collectives: list[dict[str, int]] | None = None) -> dict[str, Any]:
    """STEPS AdamW steps of a tiny Llama, clipped by ``method``; ``rank`` None: one process on the whole batch."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = tiny_llama(0)
    if rank is not None:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    clip = make_clipper(method, **METHODS[method])
    rows = []
    for x in _batches():
        xs = x if rank is None else x[rank * BATCH // 2 : (rank + 1) * BATCH // 2]
        model(input_ids=xs, labels=xs).loss.backward()
        if collectives is None:
            res = clip.clip_(list(model.named_parameters()))
        else:
            from torch.distributed.tensor.debug import CommDebugMode

            with CommDebugMode() as comm:
                res = clip.clip_(list(model.named_parameters()))
            collectives.append({str(k): v for k, v in comm.get_comm_counts().items()})
        rows.append({k: float(v) for k, v in res.as_floats().items()})
        opt.step()
        opt.zero_grad()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    return {
        "rows": rows,
        "weights": {n: t.tolist() for n, t in full.items() if n.endswith("layers.1.mlp.up_proj.weight")},
    }


def sharded_clipping(rank: int) -> dict[str, Any]:
    """On each of 2 ranks (a scenario of tests/integrations/test_fsdp2_ranks.py's shared processes, whose process
    group it uses): every method's run on this rank's half of the batches, with the collectives of each clip."""
    result = {}
    for method in METHODS:
        collectives: list[dict[str, int]] = []
        result[method] = {**_train(method, rank, collectives), "collectives": collectives}
    return result


def check_clipping_as_one_process(two_ranks: dict[str, Any], method: str) -> None:
    """Tolerance: the global norm is summed in another order (each rank's shards, then across ranks), so it agrees
    to float32 rounding (relative 1e-5 here, measured about 2e-7), not bit for bit; every clip decision is the same;
    the weights after 6 AdamW steps agree to 1e-5."""
    one = _train(method, None)
    two = two_ranks[method]
    assert len(two["rows"]) == len(one["rows"]) == STEPS
    for step, (a, b) in enumerate(zip(one["rows"], two["rows"], strict=True), start=1):
        assert a["clipped"] == b["clipped"], (method, step)
        for key in ("total_norm", "threshold", "clipped_fraction"):
            if key in a and a[key] == a[key]:  # NaN: the method has no such value
                assert b[key] == pytest.approx(a[key], rel=1e-5), (method, step, key)
    clipped = sum(r["clipped"] for r in one["rows"])
    assert clipped > 0, f"{method} never clipped: the comparison would show nothing"
    for name, w in one["weights"].items():
        assert torch.allclose(torch.tensor(two["weights"][name]), torch.tensor(w), atol=1e-5), name


def check_one_all_reduce_and_no_gather(two_ranks: dict[str, Any]) -> None:
    """The global norm of shards costs one all-reduce per clip, and AGC gathers nothing."""
    for method in ("norm", "zclip", "autoclip"):
        for step, counts in enumerate(two_ranks[method]["collectives"], start=1):
            assert counts == {"c10d.allreduce_": 1}, (method, step, counts)
    # AGC scales each row by its own norm: FSDP2 shards whole rows, so it needs only the reported global norm
    for counts in two_ranks["agc"]["collectives"]:
        assert not any("gather" in k for k in counts), counts


def test_a_gradient_not_yet_reduced_is_refused(tmp_path):
    """A ``Partial`` DTensor gradient's squared norm is not the sum of the ranks' squared norms: refused by name."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from hf_mixedprec.training.clipping_base import global_grad_norm

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        g = DTensor.from_local(torch.ones(3), mesh, [Partial()])
        with pytest.raises(ValueError, match="still Partial"):
            global_grad_norm([g])
    finally:
        dist.destroy_process_group()
