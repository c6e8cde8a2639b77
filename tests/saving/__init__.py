"""Saving and loading in one place: peft_slim.save_pretrained (plain_lora, distributed) / from_pretrained, vanilla
PEFT loading, the atomic folder swap."""
