"""Shared helpers of the planner, recipe and command-line tests: the planner's small models, ``peft-slim train``'s
own parsing of its flags, and a measurement of a training step's peak that owes nothing to the package (the
process's resident high-water mark)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import subprocess
import sys
from unittest import mock

import transformers
from peft import LoraConfig

import peft_slim
from peft_slim.cli.train import parse_flags


def llama_config(**extra) -> transformers.LlamaConfig:
    """A small Llama's config (the planner estimates from the config alone), ``extra`` fields changed or added."""
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    values.update(num_key_value_heads=2, vocab_size=500, architectures=["LlamaForCausalLM"])
    return transformers.LlamaConfig(**{**values, **extra})


def bert_config() -> transformers.BertConfig:
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=500)
    return transformers.BertConfig(**values, num_labels=3, architectures=["BertForSequenceClassification"])


def vit_config() -> transformers.ViTConfig:
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    return transformers.ViTConfig(**values, image_size=64, patch_size=4, num_labels=3)


def checked_train_args(flags: list[str]) -> argparse.Namespace:
    """``flags`` parsed and checked by the real ``peft-slim train`` code."""
    return parse_flags(flags)


def _lora(task_type: str = "CAUSAL_LM") -> LoraConfig:
    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type=task_type)


def _tokentune(ratio: float, bits: int | None = None, task_type: str = "CAUSAL_LM"):
    compression = {} if bits is None else {"activation_compression": {"bits": bits}}
    return peft_slim.TokenTuneConfig(task_type=task_type, token_ratio=ratio, lora=_lora(task_type), **compression)


_LLAMA, _BERT = dict(batch_size=8, seq_len=1024), dict(batch_size=4, seq_len=512)
# Every method and architecture the planner is checked on: name -> (model config, PEFT config, estimate_memory's
# other arguments). Sizes large enough for the measured step to stand far above the process's own noise.
MEASURED_CASES = {
    "llama lora": lambda: (llama_config(), _lora(), _LLAMA),
    "llama lora, checkpointed": lambda: (llama_config(), _lora(), {**_LLAMA, "gradient_checkpointing": True}),
    "llama full fine-tuning": lambda: (llama_config(), None, _LLAMA),
    "llama tokentune 0.2": lambda: (llama_config(), _tokentune(0.2), _LLAMA),
    "llama tokentune 0.3 8-bit": lambda: (llama_config(), _tokentune(0.3, 8), _LLAMA),
    "llama tokentune 0.2 bf16": lambda: (llama_config(), _tokentune(0.2), {**_LLAMA, "dtype": "bfloat16"}),
    "llama tokentune 0.3 8-bit bf16": lambda: (llama_config(), _tokentune(0.3, 8), {**_LLAMA, "dtype": "bfloat16"}),
    "llama lora bf16": lambda: (llama_config(), _lora(), {**_LLAMA, "dtype": "bfloat16"}),
    "llama slimfit": lambda: (llama_config(), peft_slim.SlimFitConfig(task_type="CAUSAL_LM"), _LLAMA),
    "bert tokentune 0.3": lambda: (bert_config(), _tokentune(0.3, task_type="SEQ_CLS"), _BERT),
    "bert slimfit": lambda: (bert_config(), peft_slim.SlimFitConfig(task_type="SEQ_CLS", freeze_ratio=0.75), _BERT),
    "vit full fine-tuning, checkpointed": lambda: (
        vit_config(),
        None,
        dict(batch_size=16, seq_len=None, task="image_classification", gradient_checkpointing=True),
    ),
}

_CHILD = """
import ctypes, gc, json, re, sys, warnings
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: no 2 MiB page makes the resident set jump
warnings.simplefilter("ignore")
from helpers.planner_cases import MEASURED_CASES
from peft_slim.planner.setup import after_step, make_optimizer, training_step

def resident():
    status = open("/proc/self/status").read()
    return [int(re.search(key + r":\\s+(\\d+)", status).group(1)) * 1024 for key in ("VmRSS", "VmHWM")]

peaks = {}
for name in sys.argv[1:]:
    config, peft_config, kw = MEASURED_CASES[name]()
    step = (kw["batch_size"], kw["seq_len"], "adamw", kw.get("dtype", "float32"), kw.get("task"))
    _, model, inputs = training_step(config, peft_config, *step, kw.get("gradient_checkpointing", False), "cpu", 0)
    optimizer = make_optimizer(model, "adamw")

    def train_step():
        loss = model(**inputs).loss
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        after_step(model)

    train_step(), train_step(), gc.collect()  # the optimizer state exists, as in the planner's step
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # the high-water mark restarts from the resident set
    before = resident()[0]
    train_step()
    peaks[name] = resident()[1] - before
    del model, inputs, optimizer
    gc.collect()
print(json.dumps(peaks))
"""


def resident_step_peaks(names: list[str]) -> dict[str, int]:
    """For each case, the bytes a fresh process's resident set grows by at most during one training step (its third:
    the optimizer state exists), above what it held before the step. glibc maps every block of 16 KiB or more apart
    and unmaps it when freed, so the high-water mark follows the tensors allocated and freed, buffers an operator
    frees before returning included. Linux only (``/proc/self/clear_refs``)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "16384", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_TOP_PAD_": "0"}
    env["PYTHONPATH"] = os.pathsep.join([tests, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _CHILD, *names], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# The planner's estimates recorded before its speed-up (tests/helpers/data/planner_estimates*.json): each case is a
# model config and `plan`'s arguments; every setting of its ladder (checkpointed variants included) and full
# fine-tuning are estimated one by one with `estimate_memory`, as `plan` did. Recorded with
#   PYTHONPATH=.:tests python tests/helpers/planner_cases.py tests/helpers/data/planner_estimates.json tiny
#   PYTHONPATH=.:tests python tests/helpers/planner_cases.py tests/helpers/data/planner_estimates_8b.json 8b
LLAMA3_8B = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "llama3_8b_config.json")
RECORDED_CASES = {
    "tiny": {
        "llama 2 blocks": lambda: (llama_config(), dict(batch_size=2, seq_len=64, min_token_ratio=0.05)),
        "llama 6 blocks bf16": lambda: (
            llama_config(num_hidden_layers=6),
            dict(batch_size=2, seq_len=128, dtype="bfloat16", min_token_ratio=0.2),
        ),
        "llama 5 blocks q,v sgd": lambda: (
            llama_config(num_hidden_layers=5, tie_word_embeddings=True),
            dict(batch_size=3, seq_len=48, optimizer="sgd", lora_r=4, target_modules=["q_proj", "v_proj"]),
        ),
        "bert 4 blocks": lambda: (
            transformers.BertConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                vocab_size=500,
                num_labels=3,
                architectures=["BertForSequenceClassification"],
            ),
            dict(batch_size=2, seq_len=64, min_token_ratio=0.3),
        ),
        "vit 4 blocks": lambda: (
            transformers.ViTConfig(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=4,
                num_attention_heads=4,
                image_size=32,
                patch_size=4,
                num_labels=3,
            ),
            dict(batch_size=2, seq_len=None, task="image_classification", min_token_ratio=0.5),
        ),
    },
    "8b": {
        # docs/planner.md's example: --budget 24GB --batch-size 4 --seq-len 4096 --dtype bfloat16
        "llama3-8b example": lambda: (LLAMA3_8B, dict(batch_size=4, seq_len=4096, dtype="bfloat16")),
        "llama3-8b float32 r16 sgd": lambda: (
            LLAMA3_8B,
            dict(batch_size=1, seq_len=2048, optimizer="sgd", lora_r=16, min_token_ratio=0.2),
        ),
    },
}


def estimate_case(model, arguments: dict, only=None) -> dict[str, dict[str, int]]:
    """Every setting `plan` tries for ``arguments`` (checkpointed variants included, kept or not), and full
    fine-tuning ("full", "full+ckpt"), each estimated on its own by `estimate_memory`: name -> estimate's fields.
    ``only``: those names only."""
    from dataclasses import replace

    from peft_slim.planner.plan import ladder
    from peft_slim.planner.setup import TASK_TYPES, load_config, resolve_workload

    arguments = dict(arguments)
    lora_r, min_ratio = arguments.pop("lora_r", 8), arguments.pop("min_token_ratio", 0.1)
    targets = arguments.pop("target_modules", "all-linear")
    config = load_config(model)
    step = {"optimizer": "adamw", "dtype": "float32", "task": None, **arguments}
    workload = [step[key] for key in ("batch_size", "seq_len", "optimizer", "dtype", "task")]
    task = resolve_workload(config, None, *workload).task
    step["task"] = task
    settings = ladder(lora_r, min_ratio)
    settings += [replace(c, gradient_checkpointing=True) for c in settings]
    found = {}
    for candidate in settings:
        if only is not None and candidate.name not in only:
            continue
        peft_config = candidate.peft_config(TASK_TYPES.get(task), targets)
        estimate = peft_slim.estimate_memory(
            config, peft_config, **step, gradient_checkpointing=candidate.gradient_checkpointing
        )
        found[candidate.name] = estimate.to_dict()
    for checkpointing in (False, True):
        if only is not None and ("full+ckpt" if checkpointing else "full") not in only:
            continue
        estimate = peft_slim.estimate_memory(config, None, **step, gradient_checkpointing=checkpointing)
        found["full+ckpt" if checkpointing else "full"] = estimate.to_dict()
    return found


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")
    path, group = sys.argv[1:3]
    recorded = {"command": f"PYTHONPATH=. python tests/helpers/planner_cases.py {path} {group}", "cases": {}}
    for name, case in RECORDED_CASES[group].items():
        model, arguments = case()
        recorded["cases"][name] = estimate_case(model, arguments)
        print(name, flush=True)
    with open(path, "w") as handle:
        json.dump(recorded, handle, indent=1, sort_keys=True)
        handle.write("\n")


@contextlib.contextmanager
def estimates_remembered():
    """Within it, `plan` (and ``peft-slim plan``, which calls it) estimates each distinct setting and workload once:
    a repeated one gets the estimate `plan` gave it before. For tests of what `plan` and the command do with the
    estimates (order, budget, evidence, output), not of the estimates themselves. Yields the estimates remembered
    (clear it to have the next plan estimate)."""
    module = importlib.import_module("peft_slim.planner.plan")
    real, found = module._estimate_all, {}

    def key(job):
        source, peft_config, checkpointing, workload = job
        config = source.to_json_string() if hasattr(source, "to_json_string") else repr(source)
        peft = None if peft_config is None else json.dumps(peft_config.to_dict(), sort_keys=True, default=repr)
        return config, peft, checkpointing, json.dumps(workload, sort_keys=True, default=repr)

    def remembered(jobs, processes, progress):
        new = [job for job in jobs if key(job) not in found]
        found.update(zip(map(key, new), real(new, processes, progress) if new else []))
        return [found[key(job)] for job in jobs]

    with mock.patch.object(module, "_estimate_all", remembered):
        yield found
