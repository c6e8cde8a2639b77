"""``peft-slim train``: TRL's SFT (``SFTTrainer``, its arguments, formats and loss) with a peft-slim method, built by
the flags' ``Recipe``; every flag and data row is checked before the model loads. The last line printed is the saved
folder."""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch
from peft import inject_adapter_in_model
from peft.tuners.tuners_utils import check_target_module_exists
from transformers import AutoModelForCausalLM, set_seed

from .. import SlimFitCallback, TokenTuneCallback, compress_activations
from ..planner.measure import measure_memory
from ..planner.setup import max_positions
from ..quiet import warning_silenced
from ..recipe import Recipe, trainable
from ..token_selection.selection import IGNORE_INDEX, labelled_positions, ratio_keeping_labels
from ..tokentune import find_token_selector
from ..tuner.config import MethodConfig
from ..tuner.saving import save_pretrained
from . import models, sft_data
from .arguments import UsageError, check, make_parser

HELP = "Fine-tune a causal language model with TRL's SFTTrainer and TokenTune, SlimFit, LoRA or full fine-tuning."
MIB = 2**20


def describe(recipe: Recipe) -> str:
    parts = [recipe.method]
    if recipe.token_ratio is not None:
        prompt = f", prompt ratio {recipe.prompt_ratio:g}" if recipe.prompt_ratio is not None else ""
        parts.append(f"token ratio {recipe.token_ratio:g} ({recipe.selection}{prompt})")
    if recipe.freeze_ratio is not None:
        parts.append(f"freeze ratio {recipe.freeze_ratio:g}, catch-up {recipe.catch_up}")
    parts.append(f"LoRA r={recipe.lora_r}" if recipe.uses_lora else "base weights")
    if recipe.compression_bits is not None:
        parts.append(f"compression {recipe.compression_bits}")
    elif recipe.method == "slimfit":
        parts.append("slimfit's compression")
    if recipe.gradient_checkpointing:
        parts.append("gradient checkpointing")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------ model and method
def check_output(output: str, model: str | None = None) -> None:
    """--output is a folder, or a path where one can be made (no file on the way), not ``model``'s own folder, and
    the folder holding it (where the save is staged) is writable."""
    path = Path(output).absolute()
    if model is not None and Path(model).is_dir() and Path(model).resolve() == path.resolve():
        raise UsageError(
            f"--output {output!r} is the --model folder: the save would replace the model's config and weights "
            "with what it saves; expected another folder."
        )
    for part in (path, *path.parents):
        if part.is_dir():
            break
        if part.exists() or part.is_symlink():  # a file, or a link to nothing
            what = "is a file" if part == path else f"is under {str(part)!r}, a file"
            raise UsageError(f"--output {output!r} {what}; expected a folder (new, or one to save into).")
    # The save goes where a link leads: it is staged beside the folder the link leads to.
    holder = next(folder for folder in path.resolve().parents if folder.is_dir())
    if not os.access(holder, os.W_OK | os.X_OK):
        raise UsageError(f"--output {output!r}: {str(holder)!r} is not writable; expected a folder you can write in.")


def check_model_fits(config, max_length: int, recipe: Recipe) -> None:
    """--max-length within the model's positions and --lora-r within its width (from the model's config)."""
    limit = max_positions(config)
    if limit is not None and max_length > limit:
        raise UsageError(f"--max-length {max_length}: the model has {limit} positions; expected at most {limit}.")
    width = getattr(config, "hidden_size", None)
    if recipe.uses_lora and isinstance(width, int) and recipe.lora_r > width:
        raise UsageError(f"--lora-r {recipe.lora_r}: above the model's hidden size {width}; expected at most {width}.")


def check_lora_targets(config, recipe: Recipe) -> None:
    """Each name in --lora-target-modules matches a module LoRA can adapt (PEFT's own check, a name at a time, on the
    meta device): PEFT would refuse after loading and skip a name silently when another one matches."""
    if not recipe.uses_lora or recipe.lora_target_modules == "all-linear":
        return

    def meta_model():
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        except Exception as error:  # what loading the weights would meet too (an unknown architecture, say)
            raise models.ModelError(
                f"--model {config.name_or_path!r}: no causal LM can be built from its {type(config).__name__}: {error}"
            ) from None

    modules = dict(meta_model().named_modules())
    linear = sorted({name.rsplit(".", 1)[-1] for name, layer in modules.items() if isinstance(layer, torch.nn.Linear)})
    given = f"--lora-target-modules {','.join(recipe.lora_target_modules)!r}"
    expected = f"expected comma-separated names of the model's layers, such as {', '.join(linear)}, or all-linear"
    lora = recipe.lora_config()
    for target in sorted(lora.target_modules):
        alone = replace(lora, target_modules=[target])
        kinds = {type(module).__name__ for name, module in modules.items() if check_target_module_exists(alone, name)}
        if not kinds:
            raise UsageError(f"{given}: the model has no module named {target!r}; {expected}.")
        try:
            inject_adapter_in_model(alone, meta_model(), low_cpu_mem_usage=True)
        except ValueError:
            found = ", ".join(sorted(kinds))
            raise UsageError(f"{given}: {target!r} names {found}, not a layer LoRA adapts; {expected}.") from None


def loss_kept(model, batch: dict) -> str | None:
    """What the latest training forward's token selection of ``batch`` trained and kept of its loss (and, answer
    first, the lowest ratio keeping every labelled position); None without selection."""
    selector = find_token_selector(model)  # the PEFT tuner's, or the transform's (--lora-r 0)
    if selector is None or selector.last_token_mask is None:
        return None
    config, mask = selector.config, selector.last_token_mask.cpu()
    labelled = labelled_positions(batch["labels"], causal=True)
    kept, total = int((mask & labelled).sum()), int(labelled.sum())
    real = batch["attention_mask"].bool()
    trained, tokens = int((mask & real).sum()), int(real.sum())
    rule = f"answer tokens first, prompt ratio {config.prompt_ratio:g}" if config.selection == "answer" else "random"
    head = f"token selection on the first batch (token ratio {config.token_ratio:g}, {rule}): "
    head += f"{trained} of {tokens} tokens train ({trained / tokens:.0%}); "
    if kept == total:
        return f"{head}all {total} labelled positions carry the loss"
    text = f"{head}{kept} of {total} labelled positions ({kept / total:.0%}) carry the loss, the rest are left out"
    if config.selection != "answer":
        return text
    needed = ratio_keeping_labels(batch["labels"], batch["attention_mask"].bool())
    return f"{text}; --token-ratio {math.ceil(round(float(needed.max()) * 100, 6)) / 100:g} or more keeps all of them"


def save(model, tokenizer, output: Path) -> None:
    """Save the model and tokenizer into ``output`` in one atomic swap, replacing every model file an earlier run left
    (else a full model saved over an adapter would load with the old adapter applied); other files stay."""
    # PEFT warns that a base folder without config.json (GGUF) hides vocabulary changes: the command makes none.
    with warning_silenced(UserWarning, "Could not find a config file in"):
        save_pretrained(model, str(output), tokenizer=tokenizer, replace_model_files=True)


# ------------------------------------------------------------------------------------------------------- training
def peak_lines(config, recipe: Recipe, training, dtype: str, seq_len: int) -> list[str]:
    """The step peak of the method and of LoRA + gradient checkpointing (the planner's ``measure_memory``)."""
    if training.bf16 or (recipe.activation_compression() is not None and recipe.method in ("lora", "full")):
        return [
            "peak memory of one training step: not measured (the planner's measure_memory has no bf16 autocast and "
            f"no compression for --method {recipe.method})"
        ]
    batch = training.per_device_train_batch_size
    common = {"dtype": dtype, "task": "causal_lm", "seed": training.seed}
    lora = recipe.lora_config()
    with warning_silenced(FutureWarning, "`is_gradient_checkpointing` is deprecated"):  # PEFT's call, not ours
        config = copy.copy(config)
        config.use_cache = False  # training fills no cache (and checkpointing would warn of it)
        method, checkpointing = recipe.to_peft_config(seed=training.seed), recipe.gradient_checkpointing
        ours = measure_memory(config, method, batch, seq_len, **common, gradient_checkpointing=checkpointing).peak
        baseline = measure_memory(config, lora, batch, seq_len, **common, gradient_checkpointing=True).peak
    return [
        f"peak memory of one training step (the planner's measure_memory: weights, optimizer state and the step's "
        f"peak, on {batch} x {seq_len} random tokens, every one labelled; {seq_len}: the longest of the first {batch} "
        f"examples): {ours / MIB:.1f} MiB",
        f"the same step of LoRA r={lora.r} + gradient checkpointing (TRL's SFT default): {baseline / MIB:.1f} MiB "
        f"(ratio {ours / baseline:.2f})",
    ]


def make_trainer(model, tokenizer, dataset, recipe: Recipe, training):
    """TRL's ``SFTTrainer`` training ``recipe`` on ``model``, with the method's callback and compression."""
    from trl import SFTTrainer  # its own import is heavy: loaded when training starts

    compression = recipe.activation_compression() if recipe.method in ("lora", "full") else None
    context = (lambda: compress_activations(compression)) if compression is not None else nullcontext

    class MethodTrainer(SFTTrainer):
        """SFTTrainer whose training forwards run in ``context``; it says what the first batch's selection kept."""

        selection_line = None

        def compute_loss(self, *args, **kwargs):
            with context():
                return super().compute_loss(*args, **kwargs)

        def training_step(self, model, inputs, *args, **kwargs):
            loss = super().training_step(model, inputs, *args, **kwargs)
            if self.state.global_step == 0 and self.selection_line is None:
                first = {key: inputs[key].cpu() for key in ("labels", "attention_mask")}
                self.selection_line = loss_kept(model, first) or ""
            return loss

    peft_config = recipe.to_peft_config(seed=training.seed)
    if peft_config is None or (isinstance(peft_config, MethodConfig) and peft_config.lora is None):
        model, _ = trainable(model, peft_config)  # full fine-tuning: every weight, or the method's transform
        peft_config = None
    callbacks = {"tokentune": [TokenTuneCallback()], "slimfit": [SlimFitCallback()]}.get(recipe.method, [])
    if recipe.method == "slimfit" and recipe.selects:
        callbacks.append(TokenTuneCallback())
    with warning_silenced(FutureWarning, "`is_gradient_checkpointing` is deprecated"):
        return MethodTrainer(
            model=model,
            args=training,
            train_dataset=dataset,
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=callbacks,
        )


def drop_unscored(trainer, given: int) -> int:
    """Drop the prepared rows no loss scores (TRL keeps those labelled at the first position only); how many went."""
    if not trainer.args.packing:
        trainer.train_dataset = trainer.train_dataset.filter(
            lambda row: any(label != IGNORE_INDEX for label in row["labels"][1:])
        )
    if len(trainer.train_dataset) == 0:
        raise sft_data.DataError(
            f"--max-length {trainer.args.max_length}: no example keeps a labelled token; raise --max-length."
        )
    return 0 if trainer.args.packing else given - len(trainer.train_dataset)


def parse(argv: list[str]) -> tuple:
    """(recipe, data, training, model, method arguments) of ``argv``, checked."""
    with warning_silenced(FutureWarning, "`gradient_checkpointing` is deprecated"):  # our spelling, as TRL's
        arguments = make_parser().parse_args_and_config(argv)
    return check(*arguments), *arguments


def parse_flags(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed and checked as ``peft-slim train`` does, in one namespace (every field, the method's resolved,
    and the earlier flag names)."""
    recipe, *arguments = parse(argv)
    values = {spec.name: getattr(part, spec.name) for part in arguments for spec in dataclasses.fields(part)}
    data, training, model, _ = arguments
    values |= {name: getattr(recipe, name) for name in ("method", "lora_r", "token_ratio", "selection")}
    values |= {"prompt_ratio": recipe.prompt_ratio}
    values |= {name: getattr(recipe, name) for name in ("freeze_ratio", "catch_up", "gradient_checkpointing")}
    values |= {"model": model.model_name_or_path, "dataset": data.dataset_name, "output": training.output_dir}
    values |= {"batch_size": training.per_device_train_batch_size, "num_epochs": training.num_train_epochs}
    return argparse.Namespace(
        **values, dataset_split=data.dataset_train_split, text_column=training.dataset_text_field
    )


def main(argv: list[str] | None = None) -> int:
    import yaml

    try:
        recipe, *arguments = parse(sys.argv[1:] if argv is None else argv)
    except (ValueError, argparse.ArgumentError, OSError, yaml.YAMLError) as error:  # OSError, YAML: --config's file
        print(f"peft-slim train: error: {' '.join(str(error).split())}", file=sys.stderr)
        return 2
    try:
        return train(recipe, *arguments)
    except (UsageError, sft_data.DataError, models.ModelError) as error:
        print(f"peft-slim train: error: {error}", file=sys.stderr)
        return 2


def train(recipe: Recipe, data, training, model_args, method) -> int:
    import datasets

    datasets.disable_progress_bars()  # TRL's preparation passes: the command prints what they found
    path, gguf_file, model_name = models.resolve_model(model_args.model_name_or_path, model_args.gguf_file)
    check_output(training.output_dir, path)
    rows = sft_data.read_rows(data.dataset_name, data.dataset_train_split, data.dataset_config)
    columns = sft_data.find_columns(
        rows, training.dataset_text_field, data.prompt_column, data.completion_column, data.messages_column
    )
    sft_data.check_rows(rows, columns)
    config = models.load_config(path, gguf_file)
    check_model_fits(config, training.max_length, recipe)
    check_lora_targets(config, recipe)
    print(f"model: {model_name}\nmethod: {describe(recipe)}", flush=True)
    model, tokenizer = models.load_model(path, gguf_file, model_args.dtype, config)
    dataset = sft_data.to_dataset(rows, columns, tokenizer, training.completion_only_loss, data.chat_template)
    training.dataset_text_field = "text"  # to_dataset's column of plain text
    set_seed(training.seed)
    trainer = make_trainer(model, tokenizer, dataset, recipe, training)
    dropped = drop_unscored(trainer, len(dataset))
    count = min(len(trainer.train_dataset), training.per_device_train_batch_size)
    first = trainer.data_collator([trainer.train_dataset[i] for i in range(count)])
    peaks = peak_lines(config, recipe, training, model_args.dtype, first["input_ids"].shape[-1])
    set_seed(training.seed)
    source = data.dataset_name or f"embedded {sft_data.DEFAULT_DATASET}"
    print(f"data: {source}, {columns.format} format, {len(trainer.train_dataset)} examples", end="")
    print(f" ({dropped} dropped: no labelled token within --max-length {training.max_length})" if dropped else "")
    if rows.note is not None:
        print(f"data: {rows.note}")

    start = time.perf_counter()
    with warning_silenced(UserWarning, "TokenTune under trl.SFTTrainer"):  # of TRL's logs: the CLI prints its own
        result = trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    seconds = time.perf_counter() - start
    output = Path(training.output_dir).resolve()
    save(trainer.model, tokenizer, output)
    print(
        f"trained {result.global_step} steps in {seconds:.1f} s: {result.global_step / seconds:.3f} steps/s, "
        f"final loss {result.training_loss:.4f}"
    )
    for line in [trainer.selection_line, *peaks]:
        if line:
            print(line)
    if torch.cuda.is_available():
        print(f"peak CUDA memory of the run: {torch.cuda.max_memory_allocated() / MIB:.1f} MiB")
    print(output)
    return 0
