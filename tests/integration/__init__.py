"""The methods in training loops: plain PyTorch, transformers.Trainer, TRL, DDP/FSDP2, QLoRA and other memory tools."""
