"""The three methods the adapter, LoRA-artifact and recorded-bytes tests train LoRA with on the tiny Llama (and one on
the tiny BERT), the logits they compare, and vanilla PEFT loading in a process without peft_slim."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch
from peft import LoraConfig

from helpers.tiny_models import make_batch
from helpers.vanilla_child import IMPORT_BITSANDBYTES
from peft_slim import ActivationCompressionConfig, SlimFitConfig, TokenSelectionConfig, TokenTuneConfig

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
METHODS = ["tokentune_lora", "slimfit_lora", "full_stack"]
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the helpers package is


def method_config(name: str, seed: int = 0, **lora):
    """The config of ``name`` (one of METHODS) seeded with ``seed``; ``lora`` changes or adds LoRA fields."""
    lora_config = LoraConfig(**{**LORA, **lora})
    if name == "tokentune_lora":
        return TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, seed=seed, lora=lora_config)
    if name == "slimfit_lora":
        return SlimFitConfig(task_type="CAUSAL_LM", freeze_ratio=0.5, seed=seed, lora=lora_config)
    return SlimFitConfig(  # the full stack
        task_type="CAUSAL_LM",
        freeze_ratio=0.5,
        seed=seed,
        lora=lora_config,
        token_selection=TokenSelectionConfig(token_ratio=0.5, seed=seed),
        activation_compression=ActivationCompressionConfig(bits=4, min_numel=0),
    )


def bert_dora_config(seed: int = 0) -> SlimFitConfig:
    """SlimFit + LoRA with DoRA on the tiny BERT classifier (its head saved with the adapter)."""
    return SlimFitConfig(
        task_type="SEQ_CLS", seed=seed, lora=LoraConfig(r=4, target_modules=["query", "value"], use_dora=True)
    )


def eval_inputs(arch: str = "llama") -> dict:
    """The tiny model's batch of seed 9, without its labels."""
    return {k: v for k, v in make_batch(arch, seed=9).items() if k != "labels"}


def eval_logits(model, arch: str = "llama") -> torch.Tensor:
    """``model``'s logits on ``eval_inputs(arch)``, in eval mode."""
    model.eval()
    with torch.no_grad():
        return model(**eval_inputs(arch)).logits


# A process that never imports peft_slim: PEFT's own loader on each folder, every warning recorded.
VANILLA = (
    IMPORT_BITSANDBYTES
    + """
import json, sys, warnings, torch
sys.path.insert(0, {tests!r})
from peft import PeftConfig, PeftModel
from helpers.tiny_models import build
out = {{}}
for name, folder in json.loads({folders!r}).items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = PeftConfig.from_pretrained(folder)
        model = PeftModel.from_pretrained(build({arch!r}), folder).eval()
    with torch.no_grad():
        torch.save(model(**torch.load({inputs!r})).logits, folder + ".vanilla.pt")
    # PeftModel.__init__ reads transformers' deprecated `is_gradient_checkpointing` for every adapter type.
    messages = [str(w.message) for w in caught if "is_gradient_checkpointing" not in str(w.message)]
    out[name] = {{"config": type(config).__name__, "tuner": type(model.base_model).__name__, "warnings": messages}}
out["imported"] = any(m.startswith("peft_slim") for m in sys.modules)
print("RESULT=" + json.dumps(out))
"""
)


def without_peft_slim(script: str) -> dict:
    """Run ``script`` in a fresh Python without peft_slim on its path; what it printed after ``RESULT=``, as JSON."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}  # no peft_slim on the path
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd="/", env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.split("RESULT=")[-1])


def vanilla_loads(folders: dict, root, arch: str = "llama") -> dict:
    """Load each adapter folder of ``folders`` (name: path) on the tiny ``arch`` with vanilla PEFT in one process
    that never imports peft_slim; by name, its config and tuner class and the warnings of the load; the logits on
    ``eval_inputs(arch)`` go to ``<folder>.vanilla.pt``, and ``imported`` says whether peft_slim was imported."""
    torch.save(eval_inputs(arch), root / "inputs.pt")
    folders = json.dumps(folders)
    return without_peft_slim(VANILLA.format(tests=TESTS, folders=folders, inputs=str(root / "inputs.pt"), arch=arch))
