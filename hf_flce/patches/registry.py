"""Which transformers classes each family covers, and their stock forwards.

Per-family choices live in :data:`FAMILIES` and nowhere else: every dense class gets the same fused forward, every MoE
class the MoE variant, every vision-language class (and every class whose forward takes inputs of its own) one made
from its stock forward. Classes are imported on first use, so listing a family costs nothing.
"""

from __future__ import annotations

import functools
import importlib
import typing
from collections.abc import Callable
from dataclasses import dataclass

from transformers.utils import ModelOutput


@dataclass(frozen=True)
class Target:
    """One supported causal-LM class: ``transformers.models.<model_type>.modeling_<model_type>.<class_name>``."""

    model_type: str
    class_name: str
    moe: bool = False
    package: str = ""  # the ``transformers.models`` folder, where it is not named after ``model_type``
    vision_language: bool = False  # a ``*ForConditionalGeneration`` whose loss is its text model's
    # a causal LM whose stock forward takes inputs of its own for its model (Gemma 4's per-layer inputs): its fused
    # forward is made from the stock one, as a vision-language class's is
    own_inputs: bool = False
    # a dense forward that returns its stock output class, with the body's extra fields: MoE models that balance their
    # experts without an aux loss (DeepSeek-V3's ``MoeCausalLMOutputWithPast`` carries the router logits)
    stock_output: bool = False
    # the attribute holding the decoder that the stock forward calls (GPT-2's ``transformer``)
    decoder: str = "model"

    @property
    def from_stock_forward(self) -> bool:
        """Whether the fused forward is made from the stock one (its signature, its other inputs, its output class)."""
        return self.vision_language or self.own_inputs

    @property
    def module(self) -> str:
        package = self.package or self.model_type
        return f"transformers.models.{package}.modeling_{package}"


FAMILIES: dict[str, tuple[Target, ...]] = {
    # LLaVA's text model is any causal LM (Vicuna, i.e. Llama, in LLaVA-1.5); its loss is that model's
    # Llama 4's text model routes its experts without an aux loss (its output carries the router logits)
    "llama": (
        Target("llama", "LlamaForCausalLM"),
        Target("llama4_text", "Llama4ForCausalLM", package="llama4", stock_output=True),
        Target("llava", "LlavaForConditionalGeneration", vision_language=True),
    ),
    "qwen": (
        Target("qwen2", "Qwen2ForCausalLM"),
        Target("qwen3", "Qwen3ForCausalLM"),
        Target("qwen2_moe", "Qwen2MoeForCausalLM", moe=True),
        Target("qwen3_moe", "Qwen3MoeForCausalLM", moe=True),
        Target("qwen3_next", "Qwen3NextForCausalLM", moe=True),
        Target("qwen3_5_text", "Qwen3_5ForCausalLM", package="qwen3_5"),
        Target("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", moe=True, package="qwen3_5_moe"),
        Target("qwen2_vl", "Qwen2VLForConditionalGeneration", vision_language=True),
        Target("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration", vision_language=True),
        Target("qwen3_vl", "Qwen3VLForConditionalGeneration", vision_language=True),
        # Qwen3.5's checkpoints are vision-language models; the MoE ones add the aux loss from the text config
        Target("qwen3_5", "Qwen3_5ForConditionalGeneration", vision_language=True),
        Target("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", moe=True, vision_language=True),
        Target("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", moe=True, vision_language=True),
        Target("qwen4_exp_text", "Qwen4ExpForCausalLM", moe=True, package="qwen4_exp"),
        Target("qwen4_exp", "Qwen4ExpForConditionalGeneration", moe=True, vision_language=True),
    ),
    "mistral": (
        Target("mistral", "MistralForCausalLM"),
        Target("mixtral", "MixtralForCausalLM", moe=True),
        Target("ministral", "MinistralForCausalLM"),
        Target("ministral3", "Ministral3ForCausalLM"),
        Target("mistral4", "Mistral4ForCausalLM", stock_output=True),
        Target("mistral3", "Mistral3ForConditionalGeneration", vision_language=True),
    ),
    # Gemma 2 caps its logits (``config.final_logit_softcapping``; Gemma 3's config has the field, unset), which the
    # fused forward passes to the op. Gemma 3's 4B-27B checkpoints are vision-language models.
    "gemma": (
        Target("gemma", "GemmaForCausalLM"),
        Target("gemma2", "Gemma2ForCausalLM"),
        Target("gemma3_text", "Gemma3ForCausalLM", package="gemma3"),
        Target("gemma3", "Gemma3ForConditionalGeneration", vision_language=True),
        Target("gemma4_text", "Gemma4ForCausalLM", package="gemma4", own_inputs=True),
        Target("gemma4", "Gemma4ForConditionalGeneration", vision_language=True),
        Target("gemma3n_text", "Gemma3nForCausalLM", package="gemma3n"),
        Target("vaultgemma", "VaultGemmaForCausalLM"),
    ),
    # Phi-3, Phi-3.5 and Phi-4 (``phi3``); Phi-1, 1.5 and 2, whose lm_head has a bias; Phi-3.5-MoE
    "phi": (
        Target("phi3", "Phi3ForCausalLM"),
        Target("phi", "PhiForCausalLM"),
        Target("phimoe", "PhimoeForCausalLM", moe=True),
    ),
    "olmo": (
        Target("olmo", "OlmoForCausalLM"),
        Target("olmo2", "Olmo2ForCausalLM"),
        Target("olmo3", "Olmo3ForCausalLM"),
        Target("olmoe", "OlmoeForCausalLM", moe=True),
        Target("olmo_hybrid", "OlmoHybridForCausalLM"),
        Target("flex_olmo", "FlexOlmoForCausalLM", moe=True),
    ),
    "gpt_oss": (Target("gpt_oss", "GptOssForCausalLM", moe=True),),
    "smollm": (Target("smollm3", "SmolLM3ForCausalLM"),),
    "glm": (
        Target("glm", "GlmForCausalLM"),
        Target("glm4", "Glm4ForCausalLM"),
        Target("glm4_moe", "Glm4MoeForCausalLM", stock_output=True),
        Target("glm4_moe_lite", "Glm4MoeLiteForCausalLM", stock_output=True),
        Target("glm_moe_dsa", "GlmMoeDsaForCausalLM", stock_output=True),
    ),
    "deepseek": (
        Target("deepseek_v2", "DeepseekV2ForCausalLM", stock_output=True),
        Target("deepseek_v3", "DeepseekV3ForCausalLM", stock_output=True),
        Target("deepseek_v32", "DeepseekV32ForCausalLM", stock_output=True),
        Target("deepseek_v4", "DeepseekV4ForCausalLM", moe=True),
    ),
    "kimi": (Target("kimi_linear", "KimiLinearForCausalLM", stock_output=True),),
    "minimax": (
        Target("minimax", "MiniMaxForCausalLM", moe=True),
        Target("minimax_m2", "MiniMaxM2ForCausalLM", moe=True),
    ),
    "ernie": (Target("ernie4_5", "Ernie4_5ForCausalLM"), Target("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", moe=True)),
    "hunyuan": (
        Target("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM"),
        Target("hunyuan_v1_moe", "HunYuanMoEV1ForCausalLM", stock_output=True),
        Target("hy_v3", "HYV3ForCausalLM", stock_output=True),
    ),
    "exaone": (
        Target("exaone4", "Exaone4ForCausalLM"),
        Target("exaone_moe", "ExaoneMoeForCausalLM", stock_output=True),
    ),
    "lfm": (
        Target("lfm2", "Lfm2ForCausalLM"),
        Target("lfm2_moe", "Lfm2MoeForCausalLM", stock_output=True),
        Target("lfm3", "Lfm3ForCausalLM"),
    ),
    "mimo": (Target("mimo_v2_flash", "MiMoV2FlashForCausalLM", stock_output=True),),
    "dots": (
        Target("dots1", "Dots1ForCausalLM", stock_output=True),
        Target("dots3_note_text", "Dots3NoteForCausalLM", package="dots3_note", stock_output=True),
    ),
    "axk": (Target("axk1", "AXK1ForCausalLM", stock_output=True), Target("axk2", "AXK2ForCausalLM", stock_output=True)),
    "kolibri": (Target("kolibri1", "Kolibri1ForCausalLM", stock_output=True),),
    "laguna": (Target("laguna", "LagunaForCausalLM", moe=True),),
    "mellum": (Target("mellum", "MellumForCausalLM", moe=True),),
    "solar": (Target("solar_open", "SolarOpenForCausalLM", stock_output=True),),
    "jamba": (Target("jamba", "JambaForCausalLM", moe=True),),
    "seed_oss": (Target("seed_oss", "SeedOssForCausalLM"),),
    # GPT-2-style classes take inputs of their own (token types, cross-attention states) and name their decoder
    # ``transformer`` (GPT-NeoX ``gpt_neox``): the fused forward is made from the stock one.
    # OPT's stock forward calls ``model.decoder``, which ``model``'s forward calls as it is.
    "gpt": (
        Target("gpt2", "GPT2LMHeadModel", own_inputs=True, decoder="transformer"),
        Target("gpt_neox", "GPTNeoXForCausalLM", own_inputs=True, decoder="gpt_neox"),
        Target("gptj", "GPTJForCausalLM", own_inputs=True, decoder="transformer"),
        Target("codegen", "CodeGenForCausalLM", own_inputs=True, decoder="transformer"),
    ),
    "opt": (Target("opt", "OPTForCausalLM", own_inputs=True),),
    "starcoder": (
        Target("starcoder2", "Starcoder2ForCausalLM"),
        Target("gpt_bigcode", "GPTBigCodeForCausalLM", own_inputs=True, decoder="transformer"),
    ),
    "apertus": (
        Target("apertus", "ApertusForCausalLM"),
        Target("apertus1p5_text", "Apertus1p5TextForCausalLM", package="apertus1p5"),
    ),
    "arcee": (Target("arcee", "ArceeForCausalLM"), Target("afmoe", "AfmoeForCausalLM", stock_output=True)),
    # These scale their logits: Granite divides them by ``config.logits_scaling``, Command R (Cohere) multiplies them
    # by ``config.logit_scale``; the fused forward passes the same scale to the op (``forward.op_transform``).
    "granite": (
        Target("granite", "GraniteForCausalLM"),
        Target("granitemoe", "GraniteMoeForCausalLM", moe=True),
        Target("granitemoeshared", "GraniteMoeSharedForCausalLM", moe=True),
        Target("granitemoehybrid", "GraniteMoeHybridForCausalLM", moe=True),
        Target("granite_swa", "GraniteSWAForCausalLM"),
    ),
    "cohere": (
        Target("cohere", "CohereForCausalLM"),
        Target("cohere2", "Cohere2ForCausalLM"),
        Target("cohere2_moe", "Cohere2MoeForCausalLM", stock_output=True),
    ),
    "nemotron": (
        Target("nemotron", "NemotronForCausalLM"),
        Target("nemotron_h", "NemotronHForCausalLM", stock_output=True),
    ),
    "bloom": (Target("bloom", "BloomForCausalLM", own_inputs=True, decoder="transformer"),),
    "mpt": (Target("mpt", "MptForCausalLM", own_inputs=True, decoder="transformer"),),
    "stablelm": (Target("stablelm", "StableLmForCausalLM"),),
    # Falcon-H1 multiplies its logits by ``lm_head_multiplier``, HyperCLOVA X by ``logits_scaling``, and MiniCPM3
    # divides its hidden states by it; nanochat caps its logits as Gemma 2 does
    "falcon": (
        Target("falcon_h1", "FalconH1ForCausalLM"),
        Target("falcon", "FalconForCausalLM", own_inputs=True, decoder="transformer"),
    ),
    "hyperclovax": (Target("hyperclovax", "HyperCLOVAXForCausalLM"),),
    "minicpm": (Target("minicpm3", "MiniCPM3ForCausalLM"),),
    "nanochat": (Target("nanochat", "NanoChatForCausalLM"),),
    "helium": (Target("helium", "HeliumForCausalLM"),),
    "jais": (Target("jais2", "Jais2ForCausalLM"),),
    "youtu": (Target("youtu", "YoutuForCausalLM"),),
    "cwm": (Target("cwm", "CwmForCausalLM"),),
    "persimmon": (Target("persimmon", "PersimmonForCausalLM"),),
    "diffllama": (Target("diffllama", "DiffLlamaForCausalLM"),),
    "bitnet": (Target("bitnet", "BitNetForCausalLM"),),
    "emu3": (Target("emu3", "Emu3ForCausalLM"),),
}
ALL_TARGETS: tuple[Target, ...] = tuple(t for targets in FAMILIES.values() for t in targets)
MODEL_TYPES: tuple[str, ...] = tuple(dict.fromkeys(t.model_type for t in ALL_TARGETS))

# The forward each class had before any patch, captured when the class is first loaded through this module.
_STOCK_FORWARDS: dict[type, Callable] = {}


def load_class(target: Target) -> type:
    """Import the class of ``target`` and remember its stock forward."""
    cls = getattr(importlib.import_module(target.module), target.class_name)
    _STOCK_FORWARDS.setdefault(cls, cls.__dict__["forward"])
    return cls


def installed_classes(targets: tuple[Target, ...]) -> dict[type, Target]:
    """The classes of ``targets`` that the installed transformers has. Of the supported releases (5.17-5.24), 5.17
    lacks ``Lfm3ForCausalLM`` and 5.17 and 5.23 lack ``Apertus1p5TextForCausalLM``; a release may lack or drop a
    class, and the class patch then covers the rest."""
    classes = {}
    for target in targets:
        try:
            classes[load_class(target)] = target
        except (ImportError, AttributeError):
            continue
    return classes


def loaded_classes() -> dict[type, Target]:
    """The supported classes imported so far (only those can carry a class patch)."""
    by_key = {(t.module, t.class_name): t for t in ALL_TARGETS}
    return {cls: by_key[(cls.__module__, cls.__name__)] for cls in _STOCK_FORWARDS}


def _target_in_mro(cls: type, targets: tuple[Target, ...]) -> Target | None:
    by_key = {(t.module, t.class_name): t for t in targets}
    for klass in cls.__mro__:
        target = by_key.get((klass.__module__, klass.__name__))
        if target is not None:
            return target
    return None


def find_target(model: object, targets: tuple[Target, ...] = ALL_TARGETS) -> tuple[type, Target] | None:
    """The supported class in ``type(model)``'s MRO that is one of ``targets``, with its target."""
    target = _target_in_mro(type(model), targets)
    return None if target is None else (load_class(target), target)


@functools.cache
def _decoder_attribute(cls: type) -> str:
    target = _target_in_mro(cls, ALL_TARGETS)
    return cls.base_model_prefix if target is None else target.decoder


def decoder_of(model: object) -> object:
    """The decoder that ``model``'s stock forward calls: its supported class's (:attr:`Target.decoder`), else the one
    ``base_model_prefix`` names, which ``Llama4ForCausalLM`` (``language_model``, its decoder being ``model``) gets
    wrong."""
    name = _decoder_attribute(type(model))
    decoder = getattr(model, name, None)
    if decoder is None or decoder is model:
        raise ValueError(f"{type(model).__name__} has no decoder at `{name}` for the fused head to call")
    return decoder


def stock_forward(cls: type) -> Callable:
    """The unpatched forward function of a supported class loaded by :func:`load_class`."""
    return _STOCK_FORWARDS[cls]


def output_class(target: Target) -> type | None:
    """For a target whose forward is made from the stock one, or a ``stock_output`` one, the output class its stock
    forward returns (read off its return annotation, ``tuple | <output class>``, which differs between classes and
    transformers versions)."""
    if not (target.from_stock_forward or target.stock_output):
        return None
    stock = stock_forward(load_class(target))
    annotation = typing.get_type_hints(stock).get("return")
    classes = [
        c for c in typing.get_args(annotation) or (annotation,) if isinstance(c, type) and issubclass(c, ModelOutput)
    ]
    if len(classes) != 1:
        raise TypeError(f"{target.class_name}.forward's return annotation {annotation!r} names no one output class")
    return classes[0]


def aux_loss_function(target: Target) -> Callable | None:
    """For an MoE target, the ``load_balancing_loss_func`` of its transformers module (the one stock uses)."""
    return importlib.import_module(target.module).load_balancing_loss_func if target.moe else None


def supported_classes(targets: tuple[Target, ...] = ALL_TARGETS) -> str:
    return ", ".join(t.class_name for t in targets)
