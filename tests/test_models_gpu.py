"""The patched models on a CUDA GPU, where the head runs on the Triton/cuBLAS backend instead of the torch one that
``test_patches.py`` checks on the CPU: every registered class (dense, MoE and vision-language, tied and untied)
trains as stock in float32, and under bf16 autocast (the Hopper epilogue GEMM's path) its gradient error against the
float64 model is within ``test_patches.AUTOCAST_ERROR_BOUNDS`` of stock's."""

from __future__ import annotations

import copy

import pytest
import torch
from test_patches import (
    CLASSES,
    DENSE_CLASSES,
    DENSE_VISION_LANGUAGE,
    VISION_LANGUAGE,
    _skip_without_router_logits,
    assert_autocast_error_like_stock,
    assert_same_training,
    image_batch,
    make_batch,
    make_model,
    make_vision_language_model,
)

from hf_flce import apply_flce

pytestmark = pytest.mark.gpu
TIE = pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])


def model_and_inputs(name: str, tie: bool) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny model of class ``name`` and a batch for it (an image in every row of a vision-language one)."""
    if name in VISION_LANGUAGE:
        return make_vision_language_model(name, tie), image_batch(name)
    ids, labels = make_batch(4, 32)
    return make_model(name, tie), dict(input_ids=ids, labels=labels)


class Float64Head(torch.nn.Module):
    """``lm_head`` with its logits formed in float64 and rounded once to float32: the stock model's head without
    cuBLAS's float32 rounding. Some gradients of these tiny models are sums that nearly cancel (Qwen4-Exp's vision
    patch embedding: stock with this head moves it by 1.6e-4 of its largest entry, every other parameter by under
    4e-6), and float32 rounding of the logits decides them as much as the loss does."""

    def __init__(self, head: torch.nn.Linear):
        super().__init__()
        self.weight, self.bias = head.weight, head.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.double()
        return torch.nn.functional.linear(hidden.double(), self.weight.double(), bias).float()


@TIE
@pytest.mark.parametrize("name", CLASSES + list(VISION_LANGUAGE))
def test_models_train_as_stock_on_cuda(name, tie):
    """The patched model against stock with its head in float64 (:class:`Float64Head`)."""
    _skip_without_router_logits(name)
    stock, inputs = model_and_inputs(name, tie)
    stock = stock.cuda()
    patched = apply_flce(copy.deepcopy(stock), backend="triton")
    stock.lm_head = Float64Head(stock.lm_head)
    assert_same_training(patched, stock, **{k: v.cuda() for k, v in inputs.items()})


@TIE
@pytest.mark.parametrize("name", DENSE_CLASSES + DENSE_VISION_LANGUAGE)
def test_bf16_autocast_gradient_error_like_stock_on_cuda(name, tie):
    stock, inputs = model_and_inputs(name, tie)
    assert_autocast_error_like_stock(stock, "cuda", **inputs)
