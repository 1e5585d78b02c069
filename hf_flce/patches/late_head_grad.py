"""``lm_head``'s weight gradient computed at the end of the backward (``defer_head_grad=True``), shared by the
patched forwards and the TRL trainers' fused head."""

from __future__ import annotations

import torch
from torch import nn

from ..distributed import DTensor, head_linear_cross_entropy, linear_of
from ..engine import SavedForWeightGrad, first_derivative_only


class LateHeadGrad:
    """``lm_head``'s weight gradient computed last in the backward.

    With the loss, the fused op computes dW as it goes: its float32 sum over chunks (``4 V H`` bytes) is alive at the
    end of the forward, where the step's peak is (every layer's activations are), next to a chunk. Here the loss is
    computed against the detached weight (dX and db only). An identity node on the weight, created before the layers
    run so that it has the lowest sequence number of the step's nodes, is what the loss's gradient reaches the weight
    through: the autograd engine runs it once nothing created after it is ready, after the layers' backward, when
    their activations are gone. It then recomputes the logits from the hidden states and each row's lse, both saved
    by the forward, and returns dW: one more logits GEMM, with no statistics pass and no host wait. Past the memory
    budget it walks the vocabulary in chunks, each chunk's dW rows one GEMM over every row, with no float32
    ``[V, H]`` sum; each row's target column is added in float32, as the default path adds it. The forward's moment
    then holds dX and a chunk no larger than the gradient it defers. It needs the weight whole on this device from
    the forward to the end of the backward: one GPU, DDP (where the head's gradient is then ready last, so its
    all-reduce does not overlap the backward), or FSDP2 with the head in the root unit (unsharded until the end of
    the backward)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight
        self.alias = _HeadWeightAlias.apply(weight, self)
        self.saved: SavedForWeightGrad | None = None
        self.upstream: torch.Tensor | None = None
        self.budget: int | None = None

    @classmethod
    def start(cls, head: nn.Module) -> LateHeadGrad | None:
        """Before the layers run: the deferral for ``head`` (the model's ``lm_head``), or None where its weight takes
        no gradient."""
        linear = linear_of(head)
        weight = None if linear is None else linear.weight
        if weight is None or not weight.requires_grad or not torch.is_grad_enabled():
            return None
        reason = _not_whole(linear, weight)
        if reason is not None:
            raise ValueError(
                "defer_head_grad=True needs lm_head's weight whole on this device from the forward to the end of the "
                f"backward (one GPU, DDP, or FSDP2 with lm_head in the root unit), but {reason}; use "
                "defer_head_grad=False"
            )
        return cls(weight)

    def loss(self, head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, **options):
        """:func:`hf_flce.distributed.head_linear_cross_entropy` against the detached weight (dX and db only), its
        loss tied to the alias. The alias is let go here: the graph holds it, and a reference from this object would
        close a cycle through the alias's node that only the garbage collector breaks, keeping each step's saved
        hidden states alive for several steps. Hidden states that take no gradient (a frozen trunk) leave nothing to
        defer past: dW then comes with the loss."""
        alias, self.alias = self.alias, None
        if not hidden.requires_grad:
            return head_linear_cross_entropy(head, hidden, target, **options)
        # The forward's chunks are kept within the gradient it defers (V H in the weight's dtype): its moment then
        # holds no more than a head that keeps that gradient, and thin-H heads (qwen3-0.6b: 0.29 GiB against the
        # in-model 512 MiB) take a few more chunks, which without a dW sum cost only their launches. The recompute
        # at the end of the backward, past the step's peak, takes the budget given.
        self.budget = options["memory_budget"]
        forward_budget = min(self.budget, self.weight.numel() * self.weight.element_size())
        options = {**options, "memory_budget": forward_budget, "save_for_weight_grad": self._keep}
        out = head_linear_cross_entropy(head, hidden, target, **options)
        if isinstance(out, tuple):
            return (_TieHeadGrad.apply(out[0], alias, self), *out[1:])
        return _TieHeadGrad.apply(out, alias, self)

    def _keep(self, saved: SavedForWeightGrad) -> None:
        self.saved = saved

    def weight_grad(self) -> torch.Tensor:
        """dW of the loss times its upstream gradient (the alias's backward), from what the loss's forward saved, in
        the weight's dtype (an upcast head computes it in float32)."""
        grad = self.saved.weight_grad(self.upstream, self.budget).to(self.weight.dtype)
        self.release()
        return grad

    def release(self) -> None:
        self.upstream = self.saved = None


def _not_whole(linear: nn.Module, weight: torch.Tensor) -> str | None:
    """Why ``weight`` may not be the whole weight from the forward to the end of the backward, or None."""
    if isinstance(weight, DTensor):
        return "it is a DTensor here (FSDP2 with lm_head as its own unit, or tensor parallelism)"
    if getattr(weight, "_fsdp_flattened", False):
        return "FSDP1 flattened it"
    if hasattr(weight, "ds_id"):
        return "DeepSpeed ZeRO-3 partitions it"
    if getattr(linear, "_hf_hook", None) is not None:
        return "accelerate's hooks move it (offload or a device map)"
    if not isinstance(weight, nn.Parameter):
        return (
            "it is a plain tensor here, not an nn.Parameter (FSDP1's view of its flat parameter, or a weight given by "
            "torch.func.functional_call or a parametrization), which this option cannot tell apart"
        )
    return None


class _HeadWeightAlias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, late: LateHeadGrad) -> torch.Tensor:
        ctx.late = late
        return weight.view_as(weight)

    @staticmethod
    @first_derivative_only
    def backward(ctx, _placeholder):
        return ctx.late.weight_grad(), None


class _TieHeadGrad(torch.autograd.Function):
    """The loss, passed through, with the alias as a second input: its backward hands the loss's gradient on and
    records it for the alias, which gets a zero-stride placeholder (no ``[V, H]`` memory)."""

    @staticmethod
    def forward(ctx, loss: torch.Tensor, alias: torch.Tensor, late: LateHeadGrad) -> torch.Tensor:
        ctx.late, ctx.shape, ctx.dtype = late, alias.shape, alias.dtype
        # What dW needs (the hidden states, each row's lse) goes through autograd's saved tensors, not through
        # ``late``, which the graph holds: autograd frees them after the backward (or keeps them under retain_graph)
        # where ``late`` would keep them as long as a caller keeps the loss.
        saved, late.saved = late.saved, None
        ctx.weight_grad_plan = None if saved is None else saved.plan
        if saved is not None:
            ctx.save_for_backward(*saved.tensors())
        # a copy, not a view: callers scale the loss in place (HF Trainer's ``loss *= ...``), which autograd forbids
        # on a view made inside a custom Function
        return loss.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        late = ctx.late
        late.upstream = grad
        if ctx.weight_grad_plan is not None:
            late.saved = SavedForWeightGrad(*ctx.saved_tensors, plan=ctx.weight_grad_plan)
        # let go at the end of this backward call too, for one that does not reach the weight (``autograd.grad`` or
        # ``backward(inputs=...)`` over other tensors), whose alias node then never takes them
        torch.autograd.Variable._execution_engine.queue_callback(late.release)
        return grad, grad.new_zeros((), dtype=ctx.dtype).expand(ctx.shape), None
