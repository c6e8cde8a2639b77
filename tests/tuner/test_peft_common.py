"""PEFT's own generic test suite (``tests/testing_common.py`` of PEFT's source distribution) on peft_slim's types.

``PeftCommonTester`` is what PEFT runs on every tuner type; "works as for LoRA" means passing its checks. It is not
installed with PEFT: set ``PEFT_SDIST_TESTS`` to the ``tests`` folder of the unpacked sdist of the installed PEFT
version (``pip download peft==<version> --no-binary :all: --no-deps -d DIR`` and unpack it), else this file skips.
The base model is a tiny random Llama saved to a local folder (PEFT's checks take a model id and load it); PEFT's
``test_delete_adapter_properly_cleans_up_after_itself`` (of ``test_custom_models.py``) also runs on a tiny text and
image classifier.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import peft
import pytest
import torch
from helpers.tiny_models import build
from peft import LoraConfig

from peft_slim import SlimFitConfig, TokenSelectionConfig, TokenTuneConfig

SDIST_TESTS = os.environ.get("PEFT_SDIST_TESTS", "")
if not os.path.isfile(os.path.join(SDIST_TESTS, "testing_common.py")):
    pytest.skip(
        f"PEFT's generic suite not found (PEFT_SDIST_TESTS={SDIST_TESTS!r}: the tests folder of the peft "
        f"{peft.__version__} sdist)",
        allow_module_level=True,
    )


def _import_suite():
    """testing_common.py as a module of a package of its own (it imports ``.testing_utils``); its module-level
    ``diffusers`` import (for Stable Diffusion checks not run here) gets a stand-in when diffusers is absent."""
    if importlib.util.find_spec("diffusers") is None and "diffusers" not in sys.modules:
        stand_in = types.ModuleType("diffusers")
        stand_in.StableDiffusionPipeline = type("StableDiffusionPipeline", (), {})
        sys.modules["diffusers"] = stand_in
    name = "peft_upstream_tests"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, os.path.join(SDIST_TESTS, "__init__.py"), submodule_search_locations=[SDIST_TESTS]
        )
        package = importlib.util.module_from_spec(spec)
        sys.modules[name] = package
        if os.path.isfile(spec.origin):
            spec.loader.exec_module(package)
    return importlib.import_module(f"{name}.testing_common")


PeftCommonTester = _import_suite().PeftCommonTester

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _lora(**fields):
    return LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False, **fields)


# PEFT's checks build each config as config_cls(base_model_name_or_path=model_id, **config_kwargs).
CONFIGS = {
    "tokentune_lora": (TokenTuneConfig, {"task_type": "CAUSAL_LM", "token_ratio": 0.5, "lora": _lora()}),
    "slimfit_lora": (SlimFitConfig, {"task_type": "CAUSAL_LM", "freeze_ratio": 0.5, "lora": _lora()}),
    "full_stack": (
        SlimFitConfig,
        {
            "task_type": "CAUSAL_LM",
            "freeze_ratio": 0.5,
            "lora": _lora(),
            "token_selection": TokenSelectionConfig(token_ratio=0.5),
            "activation_compression": {"bits": 4, "min_numel": 0},
        },
    ),
}
# The checks run, each a PeftCommonTester method. Not run: those of other types only (prompt learning, weighted or
# mixed adapter batches, which skip themselves for these configs), and those that need the Hub or a GPU.
CHECKS = [
    "_test_model_attr",
    "_test_adapter_name",
    "_test_prepare_for_training",
    "_test_save_pretrained",
    "_test_save_pretrained_selected_adapters",
    "_test_from_pretrained_config_construction",
    "_test_load_multiple_adapters",
    "_test_load_model_low_cpu_mem_usage",
    "_test_training",
    "_test_inference_safetensors",
    "_test_training_gradient_checkpointing",
    "_test_delete_adapter",
    "_test_delete_inactive_adapter",
    "_test_delete_unknown_adapter_raises",
    "_test_unload_adapter",
    "_test_disable_adapter",
    "_test_generate",
    "_test_merge_layers",
    "_test_merge_layers_multi",
    "_test_merge_layers_is_idempotent",
    "_test_safe_merge",
    "_test_get_base_model_state_dict",
    "_test_save_pretrained_adapter_name_substring",
    "_test_lora_conversion",
    "_test_add_adapter_no_autocast_adapter_dtype",
]
# Known to fail, and why (strict: a PEFT release that fixes it makes this file fail until the entry goes).
REFUSED_BY_PEFT = {
    "_test_add_adapter_no_autocast_adapter_dtype": "PeftModel.load_adapter takes the config class from "
    "adapter_config.json, which for a LoRA-stacked adapter is LoRA's, and refuses a LORA adapter beside a TokenTune "
    "or SlimFit one; peft_slim.load_adapter is the way (PEFT has no hook to give load_adapter the config)",
}


@pytest.fixture(scope="module")
def model_id(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-llama")
    build("llama").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def model_ids(tmp_path_factory, model_id):
    """A saved tiny model of each kind: causal LM, text classifier, image classifier."""
    ids = {"llama": model_id}
    for arch in ("bert", "vit"):
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        build(arch).save_pretrained(folder)
        ids[arch] = str(folder)
    return ids


class _Suite(PeftCommonTester):
    from transformers import AutoModelForCausalLM as transformers_class  # noqa: N813

    torch_device = "cpu"

    def prepare_inputs_for_testing(self):
        input_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16]])
        return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}

    prepare_inputs_for_common = prepare_inputs_for_testing


# Where a check's definition is not the method's: SlimFit freezes most units at each step, and a frozen unit gets no
# gradient by definition, while this check asserts that every adapter parameter gets one. It runs with
# freeze_ratio=0 instead (nothing frozen: SlimFit's hooks, token selection and compression still on).
NOTHING_FROZEN = {
    ("slimfit_lora", "_test_training_gradient_checkpointing"),
    ("full_stack", "_test_training_gradient_checkpointing"),
}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_peft_common_tester(model_id, name, check):
    if not hasattr(PeftCommonTester, check):  # another PEFT release's suite
        pytest.skip(f"PeftCommonTester.{check} is not in peft {peft.__version__}'s suite")
    config_cls, config_kwargs = CONFIGS[name]
    config_kwargs = dict(config_kwargs)
    if (name, check) in NOTHING_FROZEN:
        config_kwargs["freeze_ratio"] = 0.0
    extra = {"dtype": torch.bfloat16} if check == "_test_add_adapter_no_autocast_adapter_dtype" else {}
    if check in REFUSED_BY_PEFT:
        with pytest.raises(ValueError, match="Cannot combine adapters with different peft types"):
            getattr(_Suite(), check)(model_id, config_cls, config_kwargs, **extra)
        pytest.xfail(REFUSED_BY_PEFT[check])
    getattr(_Suite(), check)(model_id, config_cls, config_kwargs, **extra)


# PEFT's generic check that delete_adapter leaves no per-adapter state behind (in test_custom_models.py, run there on
# PEFT's own types).
@pytest.mark.parametrize("name", list(CONFIGS))
def test_delete_adapter_properly_cleans_up_after_itself(model_ids, name):
    import transformers

    check = importlib.import_module("peft_upstream_tests.test_custom_models").TestPeftCustomModel
    check = check.test_delete_adapter_properly_cleans_up_after_itself
    suite = types.SimpleNamespace(transformers_class=transformers.AutoModelForCausalLM, torch_device="cpu")
    check(suite, name, model_ids["llama"], *CONFIGS[name])
