"""SlimFit under DDP or FSDP2, one process per device, launched with torchrun.

    torchrun --nproc_per_node 2 examples/distributed_slimfit.py                      # DDP, full fine-tuning
    torchrun --nproc_per_node 2 examples/distributed_slimfit.py --fsdp               # FSDP2 (fully_shard)
    torchrun --nproc_per_node 2 examples/distributed_slimfit.py --lora --tokentune   # over LoRA, with TokenTune

Runs on CPU with the gloo backend (a tiny random Llama, a few seconds) or on GPUs with NCCL. Frozen units get
no gradient, so DDP needs find_unused_parameters=True (SlimFit raises at the first training forward without
it). Every rank takes the same freeze decisions: the schedule is seeded, and scores come from weights that are
identical on every rank (under FSDP2 each score is reduced over the shards). Set PEFT_SLIM_CHECK_RANKS=1 to
assert it at every step.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from distributed_tokentune import tiny_llama  # the same tiny random Llama (examples/ is on the path)
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import peft_slim


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    parser.add_argument("--lora", action="store_true", help="schedule LoRA adapters instead of the base weights")
    parser.add_argument("--tokentune", action="store_true", help="also backpropagate through 50%% of the tokens")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--output", default="distributed-slimfit-adapter")
    args = parser.parse_args()

    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()

    config = peft_slim.SlimFitConfig(
        task_type="CAUSAL_LM",
        freeze_ratio=0.75,
        seed=0,  # the same first sweep on every rank
        lora=LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]) if args.lora else None,
        token_selection=peft_slim.TokenSelectionConfig(token_ratio=0.5, seed=0) if args.tokentune else None,
    )
    torch.manual_seed(0)  # the same LoRA initialisation on every rank
    if args.lora:  # a LoRA adapter, through PEFT
        model = get_peft_model(tiny_llama(), config).to(device)
        schedule, plain = model.base_model, model.get_base_model()
    else:  # full fine-tuning: the plain model with SlimFit's transform
        model = plain = tiny_llama().to(device)
        schedule = peft_slim.slimfit_(model, config)
    if args.fsdp:
        for block in plain.model.layers:
            fully_shard(block)
        fully_shard(model)  # parameters become shards; SlimFit finds them again by name
        wrapped = model
    else:
        device_ids = [device.index] if device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, find_unused_parameters=True)
    # Before the first training forward every unit requires grad, so the optimizer (and DDP) hold them all.
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)
    schedule.slimfit_attach(optimizer)  # SlimFit scores the units through this optimizer's steps

    data = TensorDataset(torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(1)))
    loader = DataLoader(data, batch_size=4, sampler=DistributedSampler(data, shuffle=True, seed=0))

    wrapped.train()
    for step, (input_ids,) in zip(range(args.steps), loader):
        input_ids = input_ids.to(device)
        loss = wrapped(input_ids=input_ids, labels=input_ids).loss
        loss.backward()  # frozen units get no gradient; DDP / FSDP average the others over the ranks
        optimizer.step()
        optimizer.zero_grad()
        trained = len(schedule.trained_units)
        schedule.slimfit_step()  # score, re-rank, freeze: the same decision on every rank
        print(f"rank {rank} step {step}: loss {loss.item():.4f}, {trained} units trained", flush=True)

    peft_slim.save_pretrained(wrapped, args.output, distributed=True)  # every rank takes part; rank 0 writes
    if rank == 0:
        # a single process reads it back: the LoRA adapter, or the plain checkpoint of full fine-tuning
        reloaded = (
            PeftModel.from_pretrained(tiny_llama(), args.output)
            if args.lora
            else type(plain).from_pretrained(args.output)
        )
        print(f"saved {args.output}; reloaded as {type(reloaded).__name__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
