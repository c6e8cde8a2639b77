"""Saving and loading in one place: peft_slim.save_pretrained / from_pretrained, export_lora, vanilla PEFT loading, the
atomic folder swap."""
