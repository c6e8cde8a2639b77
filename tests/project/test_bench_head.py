"""The benchmark's restricted-head baseline (``add_labelled_head``): the model's loss, at labelled positions only."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import VOCAB, build
from peft import LoraConfig, get_peft_model

from benchmarks.harness import add_labelled_head

IGNORE = -100


def batch_with_prompts() -> dict:
    torch.manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 12))
    labels = ids.clone()
    labels[0, :5] = IGNORE  # a prompt
    labels[1, :9] = IGNORE
    labels[2, 8:] = IGNORE  # right padding
    mask = torch.ones_like(ids)
    mask[2, 8:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("checkpointing", [False, True])
def test_labelled_head_gives_the_models_loss_and_gradients(checkpointing):
    base = build("llama")
    if checkpointing:
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    lora = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False)
    full, restricted = get_peft_model(copy.deepcopy(base), lora), None
    patched = copy.deepcopy(base)
    add_labelled_head(patched)
    restricted = get_peft_model(patched, lora)
    restricted.load_state_dict(full.state_dict())
    batch = batch_with_prompts()
    losses, grads = [], []
    for model in (full, restricted):
        model.train()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.requires_grad})
    # The definition: the mean cross-entropy over the positions whose next token is labelled.
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7, msg=name)


def test_without_labels_the_forward_is_the_models_own():
    base = build("llama")
    patched = copy.deepcopy(base)
    add_labelled_head(patched)
    batch = batch_with_prompts()
    del batch["labels"]
    torch.testing.assert_close(patched(**batch).logits, base(**batch).logits)
