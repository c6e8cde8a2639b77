"""TokenTune + LoRA under DDP or FSDP2, one process per device, launched with torchrun.

    torchrun --nproc_per_node 2 examples/distributed_tokentune.py           # DDP
    torchrun --nproc_per_node 2 examples/distributed_tokentune.py --fsdp    # FSDP2 (fully_shard)

Runs on CPU with the gloo backend (a tiny random Llama, a few seconds) or on GPUs with NCCL. Each rank
trains on its own slice of the data and draws its own token selection (seed + rank); DDP / FSDP average
the gradients, so every rank ends with the same weights. Rank 0 writes an ordinary PEFT adapter that
loads in a single process.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from peft import LoraConfig, PeftModel, get_peft_model
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM

import peft_slim


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same base weights on every rank
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard instead of DDP")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--output", default="distributed-tokentune-adapter")
    args = parser.parse_args()

    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank = dist.get_rank()

    config = peft_slim.TokenTuneConfig(
        task_type="CAUSAL_LM",
        token_ratio=0.25,
        seed=0,  # each rank draws from seed + rank: different tokens per rank, reproducible
        lora=LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    )
    model = get_peft_model(tiny_llama(), config).to(device)
    if args.fsdp:
        for block in model.base_model.model.model.layers:
            fully_shard(block)
        fully_shard(model)  # parameters become shards; the module and its names stay
        wrapped = model
    else:
        wrapped = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-3)

    data = TensorDataset(torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(1)))
    sampler = DistributedSampler(data, shuffle=True, seed=0)  # each rank gets its own examples
    loader = DataLoader(data, batch_size=4, sampler=sampler)

    wrapped.train()
    for step, (input_ids,) in zip(range(args.steps), loader):
        input_ids = input_ids.to(device)
        loss = wrapped(input_ids=input_ids, labels=input_ids).loss  # the selected-token mean of this rank
        loss.backward()  # DDP / FSDP average the gradients over the ranks
        optimizer.step()
        optimizer.zero_grad()
        selected = model.base_model.last_token_mask.sum(dim=1).tolist()
        print(f"rank {rank} step {step}: loss {loss.item():.4f}, selected tokens per row {selected}", flush=True)

    # Every rank takes part (FSDP gathers the shards); rank 0 writes the adapter.
    peft_slim.save_pretrained(wrapped, args.output, distributed=True)
    if rank == 0:
        reloaded = PeftModel.from_pretrained(tiny_llama(), args.output)  # a single process reads it back
        print(f"saved {args.output}; reloaded as {type(reloaded).__name__}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
