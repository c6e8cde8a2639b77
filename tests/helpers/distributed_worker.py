"""One rank of the 2-process tests; launched by tests/integration/test_distributed.py as (tests/ on the path)

    PYTHONPATH=tests torchrun --standalone --nproc_per_node 2 tests/helpers/distributed_worker.py OUT INIT CASE...

Every case starts from the single-process checkpoint INIT/<case.init_name>, trains STEPS steps under DDP or
FSDP2 and writes OUT/<case>/rank<r>.pt (losses, masks, trainable names, full weights) and, from rank 0,
the checkpoint OUT/<case>/checkpoint. A failing case records its traceback and the others still run.
"""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

import peft_slim
from helpers.distributed_cases import (
    CASES,
    LR,
    SLIMFIT_TRAINER_INIT,
    TRAINER_INIT,
    WORLD,
    global_batches,
    labelled,
    last_token_mask,
    load_model,
    shard,
    train_step,
    trainable_names,
)
from peft_slim.slimfit import SlimFitModel
from peft_slim.token_selection.blocks import find_blocks
from peft_slim.tuner import find_tuner


def wrap(model, case):
    if case.engine == "ddp":
        return DistributedDataParallel(model, **case.ddp_options)
    for block in find_blocks(model)[1]:
        fully_shard(block)
    fully_shard(model)  # FSDP2 keeps the module (and its parameter names); parameters become DTensor shards
    return model


def run_case(case, rank: int, out_dir: str, init_dir: str) -> dict:
    model = load_model(os.path.join(init_dir, case.init_name))  # a single-process checkpoint, on every rank
    wrapped = wrap(model, case)
    optimizer = torch.optim.SGD([p for p in wrapped.parameters() if p.requires_grad], lr=LR)
    wrapped.train()
    result = {"losses": [], "masks": [], "trainable": []}
    for batch in global_batches(case):
        local = shard(batch, rank)
        if case.setup == "all_tokens":  # as Trainer does it: the global count, and the loss times the world size
            loss = train_step(model, wrapped, optimizer, local, case, num_items=labelled(batch["labels"]), world=WORLD)
        else:
            loss = train_step(model, wrapped, optimizer, local, case)
        result["losses"].append(loss)
        result["masks"].append(last_token_mask(wrapped, case))
        result["trainable"].append(trainable_names(wrapped))
    # Every rank's own copy of the full weights (DDP: local tensors; FSDP: gathered from the shards).
    full = get_model_state_dict(wrapped, options=StateDictOptions(full_state_dict=True))
    result["weights"] = {name: tensor.detach().clone() for name, tensor in full.items()}
    peft_slim.save_pretrained(wrapped, os.path.join(out_dir, case.name, "checkpoint"), distributed=True)
    return result


def run_trainer(rank: int, out_dir: str, init_dir: str) -> dict:
    """One Trainer step (2 micro-batches of 2 per rank, SGD lr=1) recording what each forward saw and returned."""
    from transformers import Trainer

    model = load_model(os.path.join(init_dir, TRAINER_INIT))
    calls = []

    def record(module, args, kwargs, output):
        if module.training:
            keep = ("input_ids", "attention_mask", "labels", "num_items_in_batch")
            calls.append({key: kwargs[key].detach().clone() for key in keep} | {"loss": output.loss.detach()})
            calls[-1]["mask"] = model.base_model.last_token_mask.clone()

    model.register_forward_hook(record, with_kwargs=True)
    args = trainer_arguments(os.path.join(out_dir, "trainer-run"), gradient_accumulation_steps=2, max_steps=1, lr=1.0)
    trainer = Trainer(model=model, args=args, train_dataset=trainer_examples(8), data_collator=pad_right)
    trainer.train()
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    weights = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    return {"calls": calls, "logged": logged, "weights": weights, "wrapper": type(trainer.model_wrapped).__name__}


def run_slimfit_trainer(rank: int, out_dir: str, init_dir: str) -> dict:
    """Trainer + SlimFitCallback, 3 steps, with Trainer's own DDP options (none given)."""
    from transformers import Trainer

    model = load_model(os.path.join(init_dir, SLIMFIT_TRAINER_INIT))
    args = trainer_arguments(os.path.join(out_dir, "slimfit-trainer-run"), gradient_accumulation_steps=1, max_steps=3)
    callbacks = [peft_slim.SlimFitCallback()]
    trainer = Trainer(
        model=model, args=args, train_dataset=trainer_examples(12), data_collator=pad_right, callbacks=callbacks
    )
    trainer.train()
    return {
        "wrapper": type(trainer.model_wrapped).__name__,
        "find_unused_parameters": getattr(trainer.model_wrapped, "find_unused_parameters", None),
        "history": find_tuner(model, SlimFitModel).slimfit_history(),
        "logged": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "weights": {name: param.detach().clone() for name, param in model.named_parameters()},
    }


def trainer_examples(count: int) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    lengths = [12, 5, 9, 7, 11, 6, 8, 10, 12, 4, 9, 6][:count]
    return [{"input_ids": torch.randint(3, 90, (n,), generator=generator).tolist()} for n in lengths]


def trainer_arguments(output_dir: str, gradient_accumulation_steps: int, max_steps: int, lr: float = LR):
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=gradient_accumulation_steps,
        max_steps=max_steps,
        optim="sgd",
        learning_rate=lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


def run_errors(rank: int, out_dir: str, init_dir: str) -> dict:
    """What refuses to work, and with which message."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    messages = {}
    model = load_model(os.path.join(init_dir, TRAINER_INIT))
    try:
        FullyShardedDataParallel(model, use_orig_params=True)
    except Exception as error:  # FSDP1 needs an accelerator; on CPU only FSDP2 runs
        messages["fsdp1_on_cpu"] = f"{type(error).__name__}: {error}"
    # SlimFit under DDP without unused-parameter detection: refused at the first training forward, not a hang.
    slimfit = DistributedDataParallel(load_model(os.path.join(init_dir, SLIMFIT_TRAINER_INIT)))
    slimfit.train()
    try:
        slimfit(input_ids=torch.ones(1, 4, dtype=torch.long))
    except Exception as error:
        messages["slimfit_ddp_without_find_unused"] = f"{type(error).__name__}: {error}"
    tuner = find_tuner(slimfit, SlimFitModel)  # PEFT_SLIM_CHECK_RANKS=1 catches a decision that differs by rank
    tuner.scheduler.trained[0] ^= rank == 1
    try:
        tuner._apply_schedule()
    except Exception as error:
        messages["slimfit_ranks_disagree"] = f"{type(error).__name__}: {error}"
    return messages


def pad_right(examples: list[dict]) -> dict:
    length = max(len(example["input_ids"]) for example in examples)
    input_ids = torch.zeros(len(examples), length, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, example in enumerate(examples):
        input_ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
        attention_mask[row, : len(example["input_ids"])] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "labels": input_ids.masked_fill(~attention_mask.bool(), -100),
    }


SPECIAL = {"trainer": run_trainer, "slimfit_trainer": run_slimfit_trainer, "errors": run_errors}


def main(out_dir: str, init_dir: str, names: list[str]) -> None:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))  # a failing case never hangs for long
    rank = dist.get_rank()
    by_name = {case.name: case for case in CASES}
    for name in names:
        try:
            if name in SPECIAL:
                result = SPECIAL[name](rank, out_dir, init_dir)
            else:
                result = run_case(by_name[name], rank, out_dir, init_dir)
        except Exception:
            result = {"error": traceback.format_exc()}
        os.makedirs(os.path.join(out_dir, name), exist_ok=True)
        torch.save(result, os.path.join(out_dir, name, f"rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
