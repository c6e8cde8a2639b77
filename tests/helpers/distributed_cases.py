"""What the 2-process tests train: one method configuration x one engine x one setup per case.

Shared by tests/integration/test_distributed.py (launch, single-process references, assertions) and
tests/helpers/distributed_worker.py (the torchrun workers), so both sides build the same models, batches and
steps. A SlimFit case is an entry of CASES like any other; it runs once ``peft_slim.SlimFitConfig`` exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from peft import LoraConfig, PeftModel, get_peft_model

import peft_slim
from helpers.tiny_models import LORA_TARGETS, VOCAB, build
from peft_slim import TokenTuneConfig
from peft_slim.tuner.saving import unwrap

WORLD = 2
ROWS_PER_RANK = 2
STEPS = 3
LR = 0.5
SEED = 11
ARCH = "llama"

# random: token_ratio=0.5, rank-dependent selections, no single-process equivalent.
# all_tokens: token_ratio=1.0, right padding with unequal token counts per rank, Trainer-style loss
#   (num_items_in_batch over all ranks, loss times the world size): equals one process on the global batch.
# token_mask: explicit masks with equal selected counts per row, plain loss: equals one process too.
SETUPS = ("random", "all_tokens", "token_mask")


@dataclass(frozen=True)
class Case:
    method: str  # "tokentune" or "slimfit"
    variant: str  # "lora", or "tokentune" (SlimFit + LoRA stacked on TokenTune)
    engine: str  # "ddp" or "fsdp" (FSDP2 fully_shard: FSDP1 needs an accelerator)
    setup: str
    ddp_options: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"{self.method}-{self.variant}-{self.engine}-{self.setup}"

    @property
    def init_name(self) -> str:
        """Cases that differ only by engine start from the same checkpoint."""
        return f"{self.method}-{self.variant}-{self.setup}"

    @property
    def uses_tokentune(self) -> bool:
        return self.method == "tokentune" or self.variant == "tokentune"

    @property
    def deterministic(self) -> bool:
        return self.setup != "random"

    @property
    def skip_reason(self) -> str | None:
        if self.method == "slimfit" and not hasattr(peft_slim, "SlimFitConfig"):
            return "peft_slim.SlimFitConfig does not exist yet"
        return None


def _cases() -> list[Case]:
    cases = []
    for engine in ("ddp", "fsdp"):
        for setup in SETUPS:
            cases.append(Case("tokentune", "lora", engine, setup))
            for variant in ("lora", "tokentune"):
                if setup == "token_mask" and variant != "tokentune":
                    continue  # token_mask is a TokenTune argument
                # Frozen units get no gradient: DDP must look for unused parameters (Trainer sets it for a PeftModel).
                cases.append(Case("slimfit", variant, engine, setup, ddp_options={"find_unused_parameters": True}))
    return cases


CASES = _cases()
TRAINER_INIT = "trainer"
SLIMFIT_TRAINER_INIT = "slimfit-trainer"


def _lora() -> LoraConfig:
    # init_lora_weights=False: B starts non-zero, so every LoRA tensor moves from the first step on.
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS[ARCH], init_lora_weights=False)


def peft_config(case: Case):
    ratio = 0.5 if case.setup == "random" else 1.0
    if case.method == "tokentune":
        return TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=ratio, seed=SEED, lora=_lora())
    tokentune = TokenTuneConfig(token_ratio=ratio, seed=SEED) if case.variant == "tokentune" else None
    return peft_slim.SlimFitConfig(
        task_type="CAUSAL_LM",
        freeze_ratio=0.5,
        lora=_lora(),
        token_selection=tokentune,
        seed=SEED,
        activation_compression=None,  # quantization groups depend on the batch: no exact 1-vs-2-process match
    )


def trainer_config() -> TokenTuneConfig:
    return TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, seed=SEED, lora=_lora())


def slimfit_trainer_config():
    """SlimFit over LoRA for the Trainer + SlimFitCallback run."""
    return peft_slim.SlimFitConfig(
        task_type="CAUSAL_LM", freeze_ratio=0.5, seed=SEED, activation_compression=None, lora=_lora()
    )


def new_model(config) -> PeftModel:
    return get_peft_model(build(ARCH, seed=0), config)


def load_model(directory: str) -> PeftModel:
    """A checkpoint written by ``save_pretrained`` on a fresh copy of the same tiny base model, with its method."""
    return peft_slim.from_pretrained(build(ARCH, seed=0), directory, is_trainable=True)


def global_batches(case: Case) -> list[dict]:
    """STEPS batches of WORLD * ROWS_PER_RANK rows; rank r trains on rows [r * ROWS_PER_RANK, ...)."""
    generator = torch.Generator().manual_seed(5)
    rows, length = WORLD * ROWS_PER_RANK, 12
    batches = []
    for _ in range(STEPS):
        input_ids = torch.randint(3, VOCAB, (rows, length), generator=generator)
        lengths = torch.full((rows,), length)
        if case.setup != "token_mask":
            lengths = torch.tensor([length, 5, 9, 7])  # right padding, unequal counts on the two ranks
        attention_mask = (torch.arange(length)[None, :] < lengths[:, None]).long()
        input_ids = input_ids.masked_fill(attention_mask == 0, 0)
        batch = {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": input_ids.masked_fill(attention_mask == 0, -100),
        }
        if case.setup == "token_mask":  # 4 of the first length-1 positions per row: equal counts of scored tokens
            scores = torch.rand(rows, length - 1, generator=generator)
            mask = torch.zeros(rows, length, dtype=torch.bool)
            mask[:, : length - 1] = scores >= scores.topk(4, dim=1).values[:, -1:]
            batch["token_mask"] = mask
        batches.append(batch)
    return batches


def shard(batch: dict, rank: int) -> dict:
    return {key: value[rank * ROWS_PER_RANK : (rank + 1) * ROWS_PER_RANK] for key, value in batch.items()}


def labelled(labels: torch.Tensor) -> torch.Tensor:
    """Positions a causal LM scores, counted as Trainer counts num_items_in_batch."""
    return (labels[:, 1:] != -100).sum()


def train_step(model, wrapped, optimizer, batch: dict, case: Case, num_items=None, world: int = 1) -> float:
    """One optimizer step; ``num_items`` and ``world`` reproduce Trainer's loss under several processes."""
    kwargs = dict(batch)
    if num_items is not None:
        kwargs["num_items_in_batch"] = num_items
    loss = wrapped(**kwargs).loss * world
    loss.backward()
    if case.method == "slimfit":
        unwrap(model).slimfit_attach(optimizer)  # (again for an attached one: nothing)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if case.method == "slimfit":
        unwrap(model).slimfit_step()
    return loss.item()


def trainable_names(model) -> list[str]:
    return sorted(name for name, param in unwrap(model).named_parameters() if param.requires_grad)


def last_token_mask(model, case: Case) -> torch.Tensor | None:
    if not case.uses_tokentune:
        return None
    mask = getattr(unwrap(model).base_model, "last_token_mask", None)
    return None if mask is None else mask.clone()
