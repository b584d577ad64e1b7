"""Pipeline receive buffers for the micro-batches in flight only.

torch.distributed.pipelining's PipelineStage allocates, when a schedule first runs, one receive buffer per micro-batch
of the step for every activation a stage receives and for every gradient it receives back, (b, s, h) each, live the
whole step: 9 GiB a GPU for GPT-3 175B at tp 8 x pp 8 with 64 micro-batches. Megatron holds only the micro-batches in
flight. InFlightStage does the same, for every schedule (GPipe, 1F1B, interleaved 1F1B) and for int8 activations
(runtime.compression.activations: the int8 rows are the buffer):

- a micro-batch's buffers are allocated when its receive is posted (get_fwd_recv_ops, get_bwd_recv_ops), fresh each
  time, so nothing received is ever overwritten: values, losses and gradients are torch's own;
- they are dropped once its backward has run (backward_one_chunk): the received activation was the stage's input,
  which autograd kept for that backward; the received gradient was its output gradient. With no backward to follow
  (a forward without grad), the activation is dropped after the forward;
- on the last stage the micro-batch's loss is detached after its backward, as torch detaches a last stage's output:
  the schedule keeps every loss to the step's end, and a loss's autograd graph ends in the stage input's
  AccumulateGrad node, which holds the received activation (without this, every micro-batch's buffer lived on to
  the last backward).

Between, each _RecvInfo holds an empty placeholder of the buffer's dtype, so torch's bookkeeping (which reads a None
buffer as a non-differentiable output's) is unchanged. What the schedule's own references keep a little longer (the
P2P ops of the last receive and send), and what is live at a stage's peak: planner.cost.memory_activations
pipeline_receive_buffer_bytes. The validation forward (runtime/parallel/pipeline_eval.py) does not run the schedule:
it receives each hidden state into a tensor of its own, dropped after that micro-batch.
"""

from __future__ import annotations

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining._utils import _make_tensor_from_meta


def _received(info) -> bool:
    """Whether a _RecvInfo stands for a tensor received from another stage (not a model input, nor a
    non-differentiable output's gradient, whose buffer torch leaves None)."""
    return info.buffer is not None and not info.is_root_arg


def _drop(infos) -> None:
    """Drop the receive buffers of one micro-batch: an empty tensor of each one's dtype stands in."""
    for info in infos:
        if _received(info):
            info.buffer = torch.empty(0, dtype=info.buffer.dtype, device=info.buffer.device)


def _allocate(infos, device: torch.device) -> None:
    """A fresh buffer for each tensor one micro-batch receives, from its metadata (as torch makes it)."""
    for info in infos:
        if _received(info) and info.tensor_meta is not None:
            info.buffer = _make_tensor_from_meta(info.tensor_meta, device)


class InFlightStage(PipelineStage):
    """A PipelineStage whose receive buffers live from a micro-batch's receive to its backward (module docstring)."""

    def _setup_forward_recv_info(self, num_microbatches: int, has_backward: bool) -> None:
        # torch allocates every micro-batch's activation buffers here: make one micro-batch's at a time, dropped
        made = {}
        for chunk_id in range(num_microbatches):
            super()._setup_forward_recv_info(1, has_backward)  # fills args_recv_info[0]
            made[chunk_id] = self.args_recv_info[0]
            _drop(made[chunk_id])
        self.args_recv_info.update(made)

    def _create_grad_recv_info(self, act_send_info: dict):
        infos = super()._create_grad_recv_info(act_send_info)  # one micro-batch's gradient buffers
        _drop(infos)
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
        if not (self.has_backward and torch.is_grad_enabled()):  # no backward will drop them
            _drop(self.args_recv_info.get(fwd_chunk_id, ()))
        return output

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, last_backward=False):
        super().backward_one_chunk(bwd_chunk_id, loss, full_backward, last_backward)
        # dropping a reference is always safe (what torch still needs holds its own, e.g. a zero-bubble schedule's
        # weight backward); detaching the loss is not before that weight backward
        _drop(self.args_recv_info.get(bwd_chunk_id, ()))
        _drop(self.grad_recv_info.get(bwd_chunk_id, ()))
        if full_backward and loss is not None and not loss._is_view():  # a view cannot be detached in place
            loss.detach_()  # its graph held the received activation (module docstring); its value stays
