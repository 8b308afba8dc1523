"""``StorageAdamW``: AdamW whose master weights and moments are stored as a recipe's ``storage:`` section says.

The update is torch's fused AdamW kernel (``torch._fused_adamw_``, the kernel behind ``AdamW(fused=True)`` and
Trainer's ``adamw_torch_fused``: decoupled weight decay, bias-corrected moments, ``eps`` outside the square root)
run on FP32 masters, gradients and moments, so an FP32 master ends bit for bit where ``AdamW(fused=True)`` ends.
Parameters are updated in runs (one device, one dtype, at most ``chunk_elements`` elements): a run's BF16 weights,
remainders and moments are gathered into flat FP32 buffers with one copy each, the kernel updates them, and one
copy each writes them back. A step's operations grow with its runs, not with the parameters in them (on a GPU a
kernel launch per operation per run, where a per-parameter loop launches one per operation per parameter: many
small parameters, LoRA adapters or norms, cost what one large one does), and the extra memory during a step is a
few FP32 buffers of one run (:data:`CHUNK_ELEMENTS`, or the largest parameter), not of the model. What is stored between steps is per
parameter dtype:

* FP32 parameters are their own master (``master: fp32``);
* BF16 parameters get the master their recipe chose: ``bf16_remainder`` (the BF16 weight plus the 16 bits BF16
  drops, an int16 per element: the FP32 master exactly, see :mod:`hf_mixedprec.storage.bits`), ``bf16_kahan`` (a
  BF16 compensation buffer), ``bf16_stochastic`` (stochastic rounding from a generator seeded afresh for every run
  of parameters at every step from the seed, the optimizer's step count, the run and the rank's shard: a resumed run
  draws the same numbers with nothing saved but that count, and data-parallel replicas draw alike), or ``none``
  (round to nearest: updates below half a BF16 ulp are lost; chosen explicitly only);
* moments (``exp_avg``, ``exp_avg_sq``) in ``state_dtype``: float32, or bfloat16 written with stochastic rounding
  (round to nearest would freeze ``exp_avg_sq``'s 0.1%-a-step decay).

No host read: bias corrections come from the step count on the device, and like torch's fused AdamW the optimizer
takes ``found_inf``/``grad_scale`` from a ``GradScaler`` (``_step_supports_amp_scaling``) and skips a flagged step
on the device, weights, moments, remainders and step count alike.

On a CPU, a BF16 parameter of :data:`~hf_mixedprec.storage.single_pass.MIN_ELEMENTS` elements or more whose master is
``bf16_remainder``, ``bf16_kahan`` or ``none`` with FP32 moments is updated by one compiled loop instead
(:mod:`hf_mixedprec.storage.single_pass`; ``single_pass="off"`` turns it off), with the same bits, checked once per
process against the step above; where they differ the optimizer says so (a warning, and
:meth:`StorageAdamW.take_notes` for the run report) and keeps the step above. A CPU reads its own values without a
sync, so that loop takes the step count and ``found_inf`` on the host.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from hf_mixedprec.core._private import foreach_add_, foreach_sub_, fused_adamw_
from hf_mixedprec.core.errors import StorageRefusal
from hf_mixedprec.storage.bits import hash_seed, stochastic_round_bf16
from hf_mixedprec.storage.masters import gather, gather_master, scatter, store_master
from hf_mixedprec.storage.single_pass import SinglePass

__all__ = ["CHUNK_ELEMENTS", "MASTER_MODES", "StorageAdamW", "keeps_updates", "pending_state", "saved_storage"]

#: How a BF16 parameter's master is kept (``storage.master`` minus ``fp32``, which upcasts the parameter itself).
MASTER_MODES: tuple[str, ...] = ("fp32", "bf16_remainder", "bf16_kahan", "bf16_stochastic", "none")

#: Elements of one run of parameters updated together, by device type (4 bytes each in every FP32 temporary of a
#: step; a larger parameter is a run of its own). On a CPU a run's buffers stay in cache (measured fastest at 2**18 by
#: ``scripts/bench_storage_step.py``); on a GPU a run is a few kernel launches, so runs are long.
CHUNK_ELEMENTS: dict[str, int] = {"cpu": 1 << 18, "default": 1 << 22}

#: Remainders / compensations made when FP32 weights were split into BF16 before the optimizer existed (the Trainer
#: builds it later); the optimizer takes each into its state at the parameter's first step. Weak: an entry goes with
#: its parameter when no optimizer ever takes it (``estimate``'s fake model).
_PENDING: dict[int, tuple[weakref.ref[torch.Tensor], dict[str, torch.Tensor]]] = {}

#: The same entries (the same dicts: taking one by either way takes it from both) by model and parameter name, for a
#: parameter that sharding replaced: FSDP2's ``fully_shard`` puts a new DTensor Parameter where the split one was
#: (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), under the same name. Weak on the model.
_PENDING_BY_NAME: dict[int, tuple[weakref.ref[torch.nn.Module], dict[str, dict[str, torch.Tensor]]]] = {}


def pending_state(
    entries: Iterable[tuple[torch.nn.Parameter, str, torch.Tensor]],
    model: torch.nn.Module | None = None,
    names: dict[int, str] | None = None,
) -> None:
    """Hand the optimizer the ``remainder`` or ``compensation`` of parameters split from FP32 before it was built;
    with ``model`` and ``names`` (parameter id -> name in ``model``) also by name, so that the optimizer of a model
    sharded afterwards finds them for the sharded parameter."""
    for p, key, value in entries:
        got = _PENDING.get(id(p))
        if got is None or got[0]() is not p:
            got = _PENDING[id(p)] = (weakref.ref(p), {})
            weakref.finalize(p, _PENDING.pop, id(p), None)
        got[1][key] = value
        if model is not None and names is not None and id(p) in names:
            held = _PENDING_BY_NAME.get(id(model))
            if held is None or held[0]() is not model:
                held = _PENDING_BY_NAME[id(model)] = (weakref.ref(model), {})
                weakref.finalize(model, _PENDING_BY_NAME.pop, id(model), None)
            held[1][names[id(p)]] = got[1]


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the same storage: writing it writes the DTensor), any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _take_pending(p: torch.Tensor, key: str) -> torch.Tensor | None:
    got = _PENDING.get(id(p))
    if got is not None and got[0]() is p:
        return got[1].pop(key, None)
    if not isinstance(p, DTensor):
        return None
    for model_ref, by_name in list(_PENDING_BY_NAME.values()):
        model = model_ref()
        if model is None:
            continue
        name = next((n for n, q in model.named_parameters() if q is p), None)
        if name is not None and key in by_name.get(name, {}):
            full = by_name[name].pop(key)
            # rank 0's split, as its weights are the ones Accelerate broadcasts: each rank's shard of it, laid out as
            # the parameter's (FSDP2 chunks dim 0 as a DTensor Shard(0) does); sent as FP32, which holds every int16
            # and BF16 value exactly (gloo scatters neither dtype)
            sent = distribute_tensor(full.to(p.device, torch.float32), p.device_mesh, p.placements, src_data_rank=0)
            return sent.to(full.dtype)
    return None


class StorageAdamW(torch.optim.Optimizer):
    """AdamW with the storage choices of the module docs. Hyperparameters as torch's ``AdamW``."""

    _step_supports_amp_scaling = True  # reads GradScaler's found_inf / grad_scale like torch's fused AdamW

    def __init__(
        self,
        params: Any,
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        master: str = "fp32",
        state_dtype: torch.dtype = torch.float32,
        seed: int = 0,
        chunk_elements: int | None = None,
        single_pass: str = "auto",
    ) -> None:
        if master not in MASTER_MODES:
            raise ValueError(f"master {master!r} (allowed: {', '.join(MASTER_MODES)})")
        if state_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"state_dtype {state_dtype} (allowed: torch.float32, torch.bfloat16)")
        if not float(lr) >= 0.0:
            raise ValueError(f"lr {lr} (allowed: >= 0)")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas {betas} (allowed: each in [0, 1))")
        if chunk_elements is not None and chunk_elements < 1:
            raise ValueError(f"chunk_elements {chunk_elements} (allowed: >= 1)")
        if eps < 0.0 or weight_decay < 0.0:
            raise ValueError(f"eps {eps}, weight_decay {weight_decay} (allowed: >= 0)")
        # the storage choice also rides in every parameter group: Distributed Checkpoint's optimizer state dict keeps
        # "state" and "param_groups" only (torch/distributed/checkpoint/state_dict.py), so a sharded checkpoint
        # still says what it was trained with
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        defaults |= {"storage_master": master, "storage_states": str(state_dtype).removeprefix("torch.")}
        # the stochastic rounding's seed and this optimizer's step count: a resumed run rounds on with the
        # checkpoint's (Python ints, which Distributed Checkpoint keeps with the groups)
        defaults |= {"storage_seed": seed, "storage_steps": 0}
        super().__init__(params, defaults)
        self.master = master
        self.state_dtype = state_dtype
        self.seed = seed
        self.chunk_elements = chunk_elements
        self._single = SinglePass(master, state_dtype, single_pass, _grad, _multi_pass_reference)
        self._generators: dict[torch.device, torch.Generator] = {}

    def take_notes(self) -> list[str]:
        """What it decided since the last call (its single pass turned down, and why) for the run report."""
        return self._single.take_notes()

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["hf_mixedprec"] = {"master": self.master, "state_dtype": str(self.state_dtype).removeprefix("torch.")}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        ours = saved_storage(state_dict)
        state_dict = dict(state_dict)
        state_dict.pop("hf_mixedprec", None)
        wanted = {"master": self.master, "state_dtype": str(self.state_dtype).removeprefix("torch.")}
        if ours is None and state_dict.get("state"):
            raise StorageRefusal(
                f"the optimizer checkpoint was not written by StorageAdamW (no remainders, compensation or rounding "
                f"state), and this run keeps storage.master {self.master} with optimizer_states "
                f"{wanted['state_dtype']}: resume with the recipe the checkpoint was trained with"
            )
        for key, value in wanted.items():
            if ours is not None and ours.get(key) != value:
                name = "master" if key == "master" else "optimizer_states"
                raise StorageRefusal(
                    f"storage.{name}: the optimizer checkpoint was written with {ours.get(key)!r}, this run has "
                    f"{value!r} (allowed: the value the checkpoint was trained with)"
                )
        # torch casts floating state to the parameter's dtype on load; the moments and buffers keep their own
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        # the saved groups name each parameter by its index, or under Distributed Checkpoint by its qualified name;
        # torch pairs them with this optimizer's parameters by position, and so does this
        saved_keys = [k for g in state_dict["param_groups"] for k in g["params"]]
        for saved_key, p in zip(saved_keys, (p for g in self.param_groups for p in g["params"])):
            for key, value in saved.get(saved_key, {}).items():
                if torch.is_tensor(value) and key in self.state[p]:
                    self.state[p][key] = value.to(device=p.device, dtype=value.dtype).clone()
        for group in self.param_groups:  # a checkpoint from before the storage choice rode in the groups
            group.setdefault("storage_master", self.master)
            group.setdefault("storage_states", wanted["state_dtype"])
            group.setdefault("storage_seed", self.seed)
            group.setdefault("storage_steps", 0)

    def _init_state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=self.state_dtype, memory_format=torch.preserve_format)
        if p.dtype == torch.bfloat16 and self.master == "bf16_remainder":
            rem = _take_pending(p, "remainder")
            state["remainder"] = rem.to(p.device) if rem is not None else torch.zeros_like(p, dtype=torch.int16)
        elif p.dtype == torch.bfloat16 and self.master == "bf16_kahan":
            comp = _take_pending(p, "compensation")
            state["compensation"] = comp.to(p.device) if comp is not None else torch.zeros_like(p)
        return state

    # -- the step -----------------------------------------------------------------------------------------------
    def _chunks(self, group: dict[str, Any]) -> list[_Run]:
        """The group's parameters that have a gradient, with their states, by device, dtype and shard (a rank's local
        shards of sharded parameters apart from whole, replicated ones: see :meth:`_seeded`), cut into runs of at
        most ``chunk_elements`` elements (default by device type: :data:`CHUNK_ELEMENTS`; a larger parameter is a run
        of its own): a step's FP32 temporaries are those of one run. FP32 weights whose gradients and moments the
        kernel can update where they are (:func:`_in_place`) need none: they are one run, marked True. Each state is
        looked up once (a tensor's hash is a Python call)."""
        by_kind: dict[tuple[torch.device, torch.dtype, int], tuple[list[torch.Tensor], list[dict[str, Any]]]] = {}
        all_states = self.state
        for p in group["params"]:
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                raise RuntimeError("StorageAdamW does not support sparse gradients")
            st = all_states[p]
            if not st:
                st = self._init_state(p)
            shard = -1  # a whole tensor, the same on every data-parallel replica
            if isinstance(p, DTensor):  # a sharded parameter (FSDP2): the update is elementwise, on the local shard
                st = _LocalState(st, _local(grad))
                coordinate = p.device_mesh.get_coordinate() or []
                shard = sum(c * 1000003**i for i, c in enumerate(coordinate))
                p = _local(p)
            params, states = by_kind.setdefault((p.device, p.dtype, shard), ([], []))
            params.append(p)
            states.append(st)
        single = self._single.pick(group, self, by_kind)  # large BF16 parameters on a CPU: one compiled loop each
        runs: list[_Run] = [_Run(*single, False, -1, True)] if single[0] else []
        scaled = getattr(self, "grad_scale", None) is not None
        for (device, dtype, shard), (params, states) in by_kind.items():
            if dtype == torch.float32 and self.state_dtype == torch.float32 and not scaled:
                # the weights are FP32 (their kind) and so are the moments (state_dtype; a checkpoint of another is
                # refused on load): what is left to check is the gradient's dtype and every layout
                fits = [
                    _grad(p, st).dtype == torch.float32
                    and p.is_contiguous()
                    and _grad(p, st).is_contiguous()
                    and st["exp_avg"].is_contiguous()
                    and st["exp_avg_sq"].is_contiguous()
                    for p, st in zip(params, states)
                ]
                if any(fits):
                    runs.append(
                        _Run(
                            [p for p, ok in zip(params, fits) if ok],
                            [st for st, ok in zip(states, fits) if ok],
                            True,
                            shard,
                        )
                    )
                    params = [p for p, ok in zip(params, fits) if not ok]
                    states = [st for st, ok in zip(states, fits) if not ok]
            limit = self.chunk_elements or CHUNK_ELEMENTS.get(device.type, CHUNK_ELEMENTS["default"])
            run: list[torch.Tensor] = []
            run_states: list[dict[str, Any]] = []
            size = 0
            for p, st in zip(params, states):
                if run and size + p.numel() > limit:
                    runs.append(_Run(run, run_states, False, shard))
                    run, run_states, size = [], [], 0
                run.append(p)
                run_states.append(st)
                size += p.numel()
            if run:
                runs.append(_Run(run, run_states, False, shard))
        return runs

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step_groups()
        return loss

    def _step_groups(self) -> None:
        """The step itself, without ``Optimizer.step``'s hooks (the single pass's check steps a reference with it)."""
        run_index = 0
        for group in self.param_groups:
            group["storage_steps"] = group.get("storage_steps", 0) + 1
            for run in self._chunks(group):
                if run.single_pass:  # draws no random numbers: the runs' seeds stay those of the multi-pass step
                    self._single.step(group, run.params, run.states, getattr(self, "found_inf", None))
                else:
                    self._step_run(group, run, run_index)
                    run_index += 1

    def _seeded(self, device: torch.device, group: dict[str, Any], run_index: int, shard: int, stream: int) -> Any:
        """The generator of one stochastic rounding, seeded on the host (no device read, no state to save) from the
        seed, the step count, the run's place in the step (runs are made in the same order at every step, and after
        a resume), the shard (a rank's local shards draw their own numbers; whole tensors, replicated on every
        data-parallel rank, draw the same) and what is rounded (0: exp_avg, 1: exp_avg_sq, 2: the weights)."""
        gen = self._generators.get(device)
        if gen is None:
            gen = self._generators[device] = torch.Generator(device=device)
        seed = group.get("storage_seed", self.seed)
        return gen.manual_seed(hash_seed(seed, group.get("storage_steps", 0), run_index, shard, stream))

    def _step_run(self, group: dict[str, Any], run: _Run, run_index: int) -> None:
        """One AdamW step of ``run.params`` (one device, one dtype, one shard; ``run.states`` theirs): torch's fused
        AdamW kernel over their FP32 masters, gradients and moments. A list whose tensors are FP32 and contiguous goes
        to the kernel as it is (updated in place; gradients only when there is no ``grad_scale`` to divide by, so a
        gradient is never changed); any other is gathered into one flat FP32 buffer and, after the kernel, written
        back in the storage the recipe chose. ``in_place``: :meth:`_chunks` found every list of the run so already.
        The number of operations does not depend on the number of parameters."""
        params, states, in_place = run.params, run.states, run.in_place
        device, dtype = params[0].device, params[0].dtype
        sizes = [p.numel() for p in params]
        grad_scale: torch.Tensor | None = getattr(self, "grad_scale", None)
        found_inf: torch.Tensor | None = getattr(self, "found_inf", None)
        grad_scale = None if grad_scale is None else grad_scale.to(device=device, dtype=torch.float32)
        if found_inf is not None:
            # GradScaler sums the flags of every device the gradients were on (2 for two GPUs); the kernel skips on 1
            found_inf = (found_inf.to(device) > 0).to(torch.float32)
        mode = "fp32" if dtype == torch.float32 else (self.master if dtype == torch.bfloat16 else "none")
        _check_master_state(params, states, mode)

        grads = [_grad(p, st) for p, st in zip(params, states)]
        avgs = [st["exp_avg"] for st in states]
        sqs = [st["exp_avg_sq"] for st in states]
        flat_master = (
            None if in_place or (mode == "fp32" and _in_place(params)) else gather_master(params, states, mode)
        )
        flat_avgs = None if in_place or _in_place(avgs) else gather(avgs)
        flat_sqs = None if in_place or _in_place(sqs) else gather(sqs)
        direct_grads = in_place or (grad_scale is None and _in_place(grads))

        def listed(flat: torch.Tensor | None, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
            return [t.view(-1) for t in tensors] if flat is None else list(flat.split(sizes))

        steps = [st["step"] for st in states]
        foreach_add_(steps, 1)
        beta1, beta2 = group["betas"]
        lr = group["lr"]
        if torch.is_tensor(lr):
            lr = float(lr) if lr.device.type == "cpu" else lr.to(device)  # a host value is no sync
        if flat_master is None and flat_avgs is None and flat_sqs is None and direct_grads:
            lists = (params, grads, avgs, sqs)  # every tensor in place, shapes alike index by index: no views
        else:
            lists = (
                listed(flat_master, params),
                listed(None, grads) if direct_grads else listed(gather(grads), grads),
                listed(flat_avgs, avgs),
                listed(flat_sqs, sqs),
            )
        fused_adamw_(
            *lists,
            steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            grad_scale=grad_scale,
            found_inf=found_inf,
        )
        if found_inf is not None:  # the kernel skipped a flagged step; so does the step count, on the device
            foreach_sub_(steps, [found_inf] * len(steps))
        for stream, (flat, store) in enumerate(((flat_avgs, avgs), (flat_sqs, sqs))):
            if flat is not None:
                # BF16 moments are stochastically rounded: with beta2 = 0.999 the decay of exp_avg_sq is 0.1% a
                # step, under half a BF16 ulp (0.2-0.4%), so round-to-nearest would hold it at its largest value
                if self.state_dtype == torch.bfloat16:
                    flat = stochastic_round_bf16(flat, self._seeded(device, group, run_index, run.shard, stream))
                scatter(flat, store, sizes)
        if flat_master is not None and not (isinstance(lr, float) and lr == 0.0):
            # a step at lr 0 leaves every master as it was, so its stored pair is left as it is: rounding a BF16
            # weight plus a compensation that is not its own (Distributed Checkpoint's resume runs such a step on
            # the checkpoint's weights before it loads their states, state_dict.py ``_init_optim_state``) could move it
            gen = self._seeded(device, group, run_index, run.shard, 2) if mode == "bf16_stochastic" else None
            store_master(params, states, mode, flat_master, sizes, gen)


def _multi_pass_reference(params: list[torch.nn.Parameter], **kwargs: Any) -> tuple[StorageAdamW, Any]:
    """What the single pass is checked against: this optimizer with it off, and its step without the global optimizer
    hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``) a user's code may have registered."""
    opt = StorageAdamW(params, single_pass="off", **kwargs)
    return opt, opt._step_groups


def saved_storage(state_dict: Any) -> dict[str, Any] | None:
    """The storage choice (``master``, ``state_dtype``) a saved optimizer state says :class:`StorageAdamW` wrote it
    with, or None for another optimizer's: its own entry, or, where Distributed Checkpoint kept only "state" and
    "param_groups", what its parameter groups carry."""
    if not isinstance(state_dict, Mapping):
        return None
    ours = state_dict.get("hf_mixedprec")
    if ours is not None:
        return dict(ours)
    groups = state_dict.get("param_groups") or []
    if groups and "storage_master" in groups[0]:
        return {"master": groups[0]["storage_master"], "state_dtype": groups[0]["storage_states"]}
    return None


class _Run(NamedTuple):
    """Parameters updated together (:meth:`StorageAdamW._chunks`): local shards of sharded ones, their states, whether
    every list goes to the kernel in place, the shard (-1: whole tensors), and whether each parameter takes the
    compiled single pass (:mod:`hf_mixedprec.storage.single_pass`) instead."""

    params: list[torch.Tensor]
    states: list[dict[str, Any]]
    in_place: bool
    shard: int
    single_pass: bool = False


class _LocalState(dict):
    """A sharded parameter's state as the step sees it: each DTensor entry by its local shard (the step writes
    every tensor in place, the step count included), and the local gradient."""

    def __init__(self, state: dict[str, Any], grad: torch.Tensor) -> None:
        super().__init__({k: _local(v) if torch.is_tensor(v) else v for k, v in state.items()})
        self.grad = grad


def _grad(p: torch.Tensor, st: dict[str, Any]) -> torch.Tensor:
    """``p``'s gradient: its own, or for a local shard the one its state carries (a local tensor has none)."""
    return st.grad if isinstance(st, _LocalState) else p.grad


def _in_place(tensors: list[torch.Tensor]) -> bool:
    """Whether the fused kernel can update ``tensors`` where they are: FP32, contiguous (so a flat view of each
    walks the tensor's own elements, in the order of the other lists' views)."""
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _check_master_state(params: list[torch.Tensor], states: list[dict[str, Any]], mode: str) -> None:
    """A BF16 parameter's state holds the master its mode keeps; one without (its state was made while it was
    FP32) would lose its master silently."""
    key = {"bf16_remainder": "remainder", "bf16_kahan": "compensation"}.get(mode)
    if key is None:
        return
    missing = [i for i, st in enumerate(states) if key not in st]
    if missing:
        shape = tuple(params[missing[0]].shape)
        raise StorageRefusal(
            f"storage.master {mode}: {len(missing)} BF16 parameter(s) (the first of shape {shape}) have no {key} in "
            "the optimizer state (their state was made while they were FP32): build the optimizer after the "
            "parameters took their storage dtype"
        )


def keeps_updates(optimizer: Any, p: torch.Tensor) -> bool:
    """Whether ``optimizer`` keeps the small updates of ``p``, a BF16 parameter, that plain rounding would lose: a
    remainder, a Kahan compensation or stochastic rounding (StorageAdamW's, or torchao's ``bf16_stochastic_round``)."""
    if p.dtype != torch.bfloat16:
        return False
    if isinstance(optimizer, StorageAdamW):
        return optimizer.master in ("bf16_remainder", "bf16_kahan", "bf16_stochastic")
    return bool(getattr(optimizer, "bf16_stochastic_round", False))
