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


@pytest.fixture
def float32_convolutions(monkeypatch):
    """cuDNN convolutions in full float32 for the test. cuDNN runs float32 convolutions in TF32 by default
    (``torch.backends.cudnn.allow_tf32``), which rounds a vision tower's patch-embedding gradient inputs to 10 bits:
    the last-bit differences the fused head leaves in the hidden states' gradient then move that weight's gradient by
    up to 1.6x this comparison's tolerance (Qwen4-Exp 1.4-1.6x, Qwen3-VL-MoE 0.9x, Qwen2.5-VL 0.7x; against stock
    with its head in float32 or in float64). In float32 every parameter of every class stays within 0.04x of it
    (H100, transformers 5.17 and 5.24)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)


@TIE
@pytest.mark.parametrize("name", CLASSES + list(VISION_LANGUAGE))
@pytest.mark.usefixtures("float32_convolutions")
def test_models_train_as_stock_on_cuda(name, tie):
    """The patched model against stock, both in float32."""
    _skip_without_router_logits(name)
    stock, inputs = model_and_inputs(name, tie)
    stock = stock.cuda()
    patched = apply_flce(copy.deepcopy(stock), backend="triton")
    assert_same_training(patched, stock, **{k: v.cuda() for k, v in inputs.items()})


@TIE
@pytest.mark.parametrize("name", DENSE_CLASSES + DENSE_VISION_LANGUAGE)
def test_bf16_autocast_gradient_error_like_stock_on_cuda(name, tie):
    stock, inputs = model_and_inputs(name, tie)
    assert_autocast_error_like_stock(stock, "cuda", **inputs)
