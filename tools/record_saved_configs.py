"""Record the config files today's code writes for one TokenTune and one SlimFit adapter on a tiny Llama
(tests/helpers/data/saved_configs/), so that a later change can be held to byte-identical adapter_config.json files
and to loading the sidecars it wrote. Run once, before a change to the configs:
`python tools/record_saved_configs.py`."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from helpers.tiny_models import build  # noqa: E402

from peft_slim import ActivationCompressionConfig, SlimFitConfig, TokenSelectionConfig, TokenTuneConfig  # noqa: E402

OUT = ROOT / "tests" / "helpers" / "data" / "saved_configs"


def configs() -> dict:
    """The configs recorded: the test that reads the files builds the same ones."""
    lora = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return {
        "tokentune": TokenTuneConfig(
            lora=LoraConfig(**lora), token_ratio=0.5, seed=3, task_type="CAUSAL_LM", modules_to_save=["lm_head"]
        ),
        "slimfit": SlimFitConfig(
            lora=LoraConfig(**lora),
            freeze_ratio=0.5,
            token_selection=TokenSelectionConfig(num_tokens=5),
            activation_compression=ActivationCompressionConfig(bits=4, kinds=["linear"]),
            task_type="CAUSAL_LM",
        ),
    }


def main() -> None:
    for name, config in configs().items():
        torch.manual_seed(0)
        model = get_peft_model(build("llama"), config)
        with tempfile.TemporaryDirectory() as folder:
            model.save_pretrained(folder)
            target = OUT / name
            target.mkdir(parents=True, exist_ok=True)
            for file in ("adapter_config.json", "peft_slim_config.json"):
                shutil.copyfile(Path(folder) / file, target / file)


if __name__ == "__main__":
    main()
