"""Pipeline receive buffers for the micro-batches in flight only.

torch.distributed.pipelining's PipelineStage allocates, when a schedule first runs, one receive buffer per micro-batch
of the step for every activation a stage receives and for every gradient it receives back, (b, s, h) each, live the
whole step: 9 GiB a GPU for GPT-3 175B at tp 8 x pp 8 with 64 micro-batches. Megatron holds only the micro-batches in
flight. InFlightStage does the same: a micro-batch's buffers are allocated when its receive is posted
(get_fwd_recv_ops, get_bwd_recv_ops) and dropped once its backward has run (backward_one_chunk: the received
activation was the stage's input, which autograd kept until then; the received gradient was that backward's output
gradient), or after its forward when no backward follows (validation). Between, each _RecvInfo holds an empty
placeholder of the buffer's dtype, so torch's bookkeeping (which skips a None buffer as a non-differentiable
output's) is unchanged. What stays live: the activation buffers of the micro-batches in flight, which are the
stages' saved inputs (planner.cost.memory_activations.pipeline_receive_buffer_bytes prices the rest).
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _make_tensor_from_meta


def _placeholder(info) -> None:
    """Drop a receive buffer: an empty tensor of its dtype stands in (see the module docstring)."""
    if info.buffer is not None and not info.is_root_arg:
        info.buffer = torch.empty(0, dtype=info.buffer.dtype, device=info.buffer.device)


def _allocate(infos, device: torch.device) -> None:
    """A fresh buffer for each received tensor of one micro-batch, from its metadata."""
    for info in infos:
        if info.buffer is not None and not info.is_root_arg and info.tensor_meta is not None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


class InFlightStage(PipelineStage):
    """A PipelineStage whose receive buffers live from a micro-batch's receive to its backward (module docstring)."""

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        # torch allocates every micro-batch's buffers here; make one micro-batch's at a time and drop them
        made = {}
        for chunk_id in range(num_microbatches):
            super()._setup_forward_recv_info(1, has_backward)  # fills args_recv_info[0]
            made[chunk_id] = self.args_recv_info[0]
            for info in made[chunk_id]:
                _placeholder(info)
        self.args_recv_info.update(made)

    def _create_grad_recv_info(self, act_send_info: dict):
        infos = super()._create_grad_recv_info(act_send_info)
        for info in infos:
            _placeholder(info)
        return infos

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        _allocate(self.args_recv_info[fwd_chunk_id], self.device)
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            _allocate(self.grad_recv_info[bwd_chunk_id], self.device)
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        output = super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        if not (self.has_backward and torch.is_grad_enabled()):  # no backward will release them
            for info in self.args_recv_info.get(fwd_chunk_id, ()):
                _placeholder(info)
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, *args, **kwargs):
        result = super().backward_one_chunk(bwd_chunk_id, loss, *args, **kwargs)
        if loss is not None and not loss._is_view():
            loss.detach_()  # TEST
        for info in (*self.args_recv_info.get(bwd_chunk_id, ()), *self.grad_recv_info.get(bwd_chunk_id, ())):
            _placeholder(info)
        return result
