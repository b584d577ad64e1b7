"""The one AdamW of zplan's plans (torch.optim.AdamW's arithmetic: decoupled weight decay, Loshchilov & Hutter
2019), put together from three parts that runtime.optim.build.build_optimizer chooses from the plan:

  layout     which elements of each parameter this rank updates, how its states are laid out, and how the
             updated elements reach the other ranks (runtime.optim.layouts): RowShards, ZeRO 0/1's dim-0 rows of
             parameters replicated over dp, gathered after the step; WholeShards, parameters that are already this
             rank's shards (FSDP2: ZeRO 2/3) or whole tensors every rank updates alike.
  states     where the fp32 states live and what steps them: DeviceStates (runtime.optim.device_states: torch's
             fused kernel), HostStates (runtime.optim.host_states: ZeRO-Offload, zplan's CPU Adam kernel, with the
             one-step delayed update as an option), NvmeStates (runtime.optim.nvme_states: ZeRO-Infinity, the
             moments swapped from files).
  gradients  how gradients travel besides DDP's own all-reduce (whose int8 hook needs nothing here):
             PlainGradients, or 1-bit Adam (runtime.compression.grad_compression.OneBitGradients), which replaces
             the update with its compressed-momentum one after its warm-up.

State dict: torch.optim.AdamW's keys per parameter ("step", "exp_avg", "exp_avg_sq"), each state laid out by the
layout (a DTensor of the parameter's global shape, or the plain tensor), so torch.distributed.checkpoint reshards it
between every combination of parts; a 16-bit parameter's fp32 master is not in it (it is the model's weight:
master_weights, runtime.checkpoint.save). load_state_dict keeps this optimizer's hyper-parameters with RowShards
(the resuming script's) and copies the loaded states into its own fp32 rows; with WholeShards it is torch's.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from zplan.runtime.optim.layouts import _local, is_16bit


class PlainGradients:
    """The gradients as DDP or FSDP2 left them: the states part does the update."""

    def bind(self, opt) -> None:
        pass

    def update(self, opt) -> bool:  # True when it did the step's update itself
        return False

    def loaded(self, opt) -> None:
        pass


class ShardedAdamW(torch.optim.Optimizer):
    """AdamW over `params` (param groups as usual; hyper-parameters as torch.optim.AdamW) made of a layout, a states
    part and a gradients part (module docstring). grad_divisor: None, or what a step divides 16-bit gradients by
    (a float or a scalar tensor: loss scale times the clipping factor), set before each step by the training loop
    (runtime.training.loop) when unscales_gradients."""

    def __init__(self, params, layout, states, gradients=None, *, lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 1e-2):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.layout, self.states = layout, states
        self.gradients = gradients if gradients is not None else PlainGradients()
        self.grad_divisor: torch.Tensor | float | None = None
        params = [p for group in self.param_groups for p in group["params"]]
        layout.bind(params)
        for p in params:
            self.state[p] = states.fresh(self, p)
        states.bind(self)
        self.gradients.bind(self)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.gradients.update(self):
            self.states.update(self)
        return loss

    # ---- masters, buffers, the delayed update, files -------------------------------------------------------

    def master(self, p: torch.Tensor) -> torch.Tensor | None:
        """The fp32 master of a 16-bit parameter (laid out as its moments, this rank's elements), None for fp32."""
        return self.states.master(self, p)

    @property
    def unscales_gradients(self) -> bool:
        """True when a parameter is 16-bit: its gradient is upcast, unscaled and clipped by the step
        (grad_divisor), not in place beforehand."""
        return any(is_16bit(p) for group in self.param_groups for p in group["params"])

    def master_weights(self) -> dict[int, torch.Tensor]:
        """{data_ptr of a 16-bit parameter's (tp-local) tensor: its fp32 master}: what a checkpoint and a weights
        file hold in its place (runtime.optim.layouts.with_master_weights)."""
        params = [p for group in self.param_groups for p in group["params"] if is_16bit(p)]
        return {_local(p.detach()).data_ptr(): self.master(p) for p in params}

    @torch.no_grad()
    def parameters_from_masters(self) -> None:
        """Every 16-bit parameter rounded from its master (after the masters were loaded), then published by the
        layout: collective over dp."""
        for group in self.param_groups:
            for p in group["params"]:
                if is_16bit(p):
                    self.layout.owned(p).copy_(_local(self.master(p)))
        self.layout.publish()

    def host_buffers(self) -> list[torch.Tensor]:
        """Host memory besides the states (runtime.training.memory_tiers, the dry run's host count)."""
        return self.states.host_buffers()

    @property
    def moments(self):
        """The swapped moments of NvmeStates (runtime.training.memory_tiers), else None."""
        return getattr(self.states, "moments", None)

    @property
    def param_swapper(self):
        """The ZeRO-3 parameter swapper of NvmeStates, else None."""
        return getattr(self.states, "param_swapper", None)

    @torch.no_grad()
    def flush(self) -> None:
        """Publish a delayed update still pending (HostStates; collective over dp when one is); else nothing."""
        self.states.flush(self)

    def close(self) -> None:
        """Remove NvmeStates' swap files; nothing for the others."""
        self.states.close()

    # ---- state dict --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """torch's, after the states part made its states whole (a pending update published, moments read from
        files), without the masters (they are the model's weights: master_weights)."""
        self.states.before_state_dict(self)
        try:
            packed = super().state_dict()
        finally:
            getattr(self.states, "after_state_dict", lambda opt: None)(self)
        packed["state"] = {index: {k: v for k, v in state.items() if k != "master"}
                           for index, state in packed["state"].items()}
        return packed

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """The loaded states (module docstring), then the states part's and the gradients part's own (host memory,
        files, step counts). A pending delayed update is dropped first."""
        getattr(self.states, "drop_pending", lambda: None)()
        if self.layout.keeps_rows_of_replicas:
            self._copy_into_rows(state_dict)
        else:
            super().load_state_dict(state_dict)
        self.states.loaded(self)
        self.gradients.loaded(self)

    def _copy_into_rows(self, state_dict: dict) -> None:
        """Copy the loaded states into this optimizer's own tensors (fp32, this rank's rows; a DTensor's local rows,
        or a plain tensor of the parameter's whole local shape, of which the owned rows are taken), or, where it
        holds none (a placeholder: NvmeStates'), take the loaded one; the hyper-parameters stay this optimizer's
        (the resuming script's, as runtime.checkpoint.save documents)."""
        params = [p for group in self.param_groups for p in group["params"]]
        indices = [index for group in state_dict["param_groups"] for index in group["params"]]
        if len(indices) != len(params):
            raise ValueError(f"the loaded optimizer state has {len(indices)} parameters, this optimizer {len(params)}")
        for p, index in zip(params, indices, strict=True):
            loaded, own = state_dict["state"].get(index, {}), self.state[p]
            for key, value in loaded.items():
                if key == "step":
                    own["step"].copy_(torch.as_tensor(value, dtype=torch.float32).reshape(()))
                elif not isinstance(own.get(key), DTensor):
                    own[key] = value
                elif key != "master":
                    local = value.to_local() if isinstance(value, DTensor) else self.layout.rows_of(value, p)
                    target = own[key].to_local()
                    if local.data_ptr() != target.data_ptr():
                        target.copy_(local)
