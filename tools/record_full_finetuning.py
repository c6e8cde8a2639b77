"""Record tests/helpers/data/full_finetuning.json from the standalone PEFT types (TokenTune / SlimFit without `lora`,
wrapped by get_peft_model), the reference the full fine-tuning transforms must match bit for bit.

Run from the repository root: ``PYTHONPATH=.:tests python tools/record_full_finetuning.py``. Needs a peft_slim that
still has the standalone types (they were replaced by ``peft_slim.tokentune_`` / ``peft_slim.slimfit_``).
"""

from __future__ import annotations

import json

import torch
from helpers.full_finetuning_cases import CASES, DATA, run_case
from helpers.tiny_models import CAUSAL_LM
from peft import get_peft_model

from peft_slim import SlimFitConfig, TokenTuneConfig

# The classifiers without a task type: PEFT would wrap their head as modules_to_save (a trained copy), which
# full fine-tuning has no use for.
TASK = {"bert": None, "roberta": None, "vit": None} | {arch: "CAUSAL_LM" for arch in CAUSAL_LM}


def standalone(model, method, fields):
    config_cls = TokenTuneConfig if method == "tokentune" else SlimFitConfig
    peft_model = get_peft_model(model, config_cls(task_type=TASK[model.config.model_type], **fields))
    return peft_model, (peft_model if method == "slimfit" else None)


def main() -> None:
    records = {name: run_case(name, standalone) for name in CASES}
    with open(DATA, "w") as handle:
        json.dump({"torch": torch.__version__, "cases": records}, handle, indent=1, sort_keys=True)
        handle.write("\n")


if __name__ == "__main__":
    main()
