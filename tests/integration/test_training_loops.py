"""TokenTune + LoRA in real training loops: plain PyTorch, transformers.Trainer, bf16 autocast on CPU.

The Trainer tests check the loss Trainer logs and the gradient it applies against an independent
recomputation: the selected-token mean (tests/helpers/reference.py) over the masks TokenTune recorded, and the
gradient of that mean under the equivalent definition of methods.md.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import reference_forward, selected_causal_lm_loss
from helpers.tiny_models import LORA_TARGETS, ONE_SGD_STEP, build, make_batch
from helpers.tokentune_cases import train_on_one_batch
from helpers.trainer_cases import AppliedGradient, load, make_dataset, make_tokenizer, trainable, training_args
from peft import LoraConfig, get_peft_model
from transformers import DataCollatorForLanguageModeling, Trainer

from peft_slim import TokenTuneConfig

# ---------------------------------------------------------------------------------------------- helpers


def tokentune_lora(
    seed: int = 0, task_type: str | None = "CAUSAL_LM", random_b: bool = True, extra_targets=(), **tokentune
):
    """A tiny llama with TokenTune + LoRA. ``random_b``: B starts non-zero, so A also gets gradients."""
    model = build("llama", seed=seed)
    tokentune.setdefault("token_ratio", 0.5)
    config = TokenTuneConfig(
        task_type=task_type,
        lora=LoraConfig(
            r=4,
            lora_alpha=8,
            lora_dropout=0.0,
            target_modules=LORA_TARGETS["llama"] + list(extra_targets),
            init_lora_weights=not random_b,
        ),
        **tokentune,
    )
    return get_peft_model(model, config)


class Recorder:
    """Records every training forward of a PeftModel: its inputs, its loss and TokenTune's mask."""

    def __init__(self, peft_model):
        self.peft_model = peft_model
        self.calls: list[dict] = []
        self.autocast = None
        self.handles = [
            peft_model.register_forward_hook(self._record, with_kwargs=True),
            # Inside the (possibly autocast-wrapped) PeftModel.forward: is autocast on there?
            peft_model.base_model.model.register_forward_pre_hook(self._inside),
        ]

    def _inside(self, module, args):
        self.autocast = torch.is_autocast_enabled("cpu")

    def _record(self, module, args, kwargs, output):
        if not module.training:
            return
        self.calls.append(
            {
                "input_ids": kwargs["input_ids"].detach().clone(),
                "attention_mask": kwargs["attention_mask"].detach().clone(),
                "labels": kwargs["labels"].detach().clone(),
                "num_items_in_batch": kwargs.get("num_items_in_batch"),
                "loss": output.loss.detach().clone(),
                "mask": self.peft_model.base_model.last_token_mask.detach().clone(),
                "autocast": self.autocast,
            }
        )

    def remove(self):
        for handle in self.handles:
            handle.remove()


def frozen(peft_model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if not p.requires_grad}


def labelled_count(labels: torch.Tensor) -> int:
    """Labelled positions a causal LM predicts (labels shifted by one), as Trainer counts them."""
    return int((labels[:, 1:] != -100).sum())


def reference_step(peft_model, calls: list[dict], weights: list[float]):
    """sum_k weights[k] * selected-token mean of micro-batch k, and its gradient by the equivalent definition.

    Computed in eval mode (TokenTune inactive) on the current weights, with the recorded masks.
    """
    inner = peft_model.base_model.model
    blocks = inner.model.layers
    peft_model.eval()
    peft_model.zero_grad(set_to_none=True)
    total = 0.0
    for call, weight in zip(calls, weights):
        with reference_forward(inner, blocks, call["mask"]):
            logits = peft_model(input_ids=call["input_ids"], attention_mask=call["attention_mask"]).logits
        loss = selected_causal_lm_loss(logits, call["labels"], call["mask"]) * weight
        loss.backward()
        total += loss.item()
    grads = {n: p.grad.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    peft_model.zero_grad(set_to_none=True)
    return total, grads


def selected_means(peft_model, calls: list[dict]) -> list[float]:
    """Each micro-batch's selected-token mean, recomputed with an ordinary eval-mode forward."""
    peft_model.eval()
    means = []
    with torch.no_grad():
        for call in calls:
            logits = peft_model(input_ids=call["input_ids"], attention_mask=call["attention_mask"]).logits
            means.append(selected_causal_lm_loss(logits, call["labels"], call["mask"]).item())
    return means


def assert_tokentune_was_active(calls: list[dict]) -> None:
    """Every recorded training forward selected a strict subset of its real tokens, never padding."""
    assert calls, "no training forward was recorded"
    for call in calls:
        real = call["attention_mask"].bool()
        assert not (call["mask"] & ~real).any(), "padding was selected"
        assert int(call["mask"].sum()) < int(real.sum()), "TokenTune selected every token: it was not active"


def run_one_step(tmp_path, peft_model, dataset, **args):
    """One optimizer step of Trainer (SGD, lr=1, no clipping, no decay) over 2 micro-batches of 2."""
    recorder = Recorder(peft_model)
    capture = AppliedGradient(peft_model)
    before = trainable(peft_model)
    trainer = Trainer(
        model=peft_model,
        args=training_args(tmp_path, **ONE_SGD_STEP, **args),
        train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(make_tokenizer(), mlm=False),
        callbacks=[capture],
    )
    trainer.train()
    recorder.remove()
    after = trainable(peft_model)
    logged = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 1 and len(recorder.calls) == 2 and len(capture.steps) == 1
    return before, after, logged[0], recorder.calls, capture.steps[0]


def run_two_steps(tmp_path, peft_model, dataset_seed: int = 0, **args) -> list[dict]:
    """Two optimizer steps of Trainer (lr 1e-2) over 8 texts of unequal lengths, each step 2 micro-batches of 2
    padded by the collator; both logged losses are finite and positive. Returns the 4 forwards Recorder saw."""
    tokenizer = make_tokenizer()
    dataset = make_dataset(tokenizer, lengths=[6, 11, 8, 12, 5, 9, 10, 7], seed=dataset_seed)
    recorder = Recorder(peft_model)
    trainer = Trainer(
        model=peft_model,
        args=training_args(tmp_path, max_steps=2, learning_rate=1e-2, **args),
        train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train()
    recorder.remove()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 2 and all(math.isfinite(x) and x > 0 for x in losses), losses
    assert len(recorder.calls) == 4  # 2 optimizer steps x 2 micro-batches
    return recorder.calls


# ---------------------------------------------------------------------------------------------- plain loop


def test_plain_pytorch_loop_trains_lora_only_and_loss_decreases():
    torch.manual_seed(0)
    # The tiny random head's logits are tiny: LoRA on lm_head too lets 20 steps fit the batch clearly.
    model = tokentune_lora(token_ratio=0.5, seed=0, random_b=False, extra_targets=["lm_head"])
    batch = make_batch("llama", batch=4, length=12, seed=1)
    base_before = frozen(model)
    lora_before = trainable(model)
    assert lora_before and all("lora_" in name for name in lora_before)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)

    def full_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss = model(**batch).loss.item()
        model.train()
        return loss

    start = full_loss()
    losses = train_on_one_batch(model, batch, optimizer, steps=20)
    end = full_loss()

    assert all(math.isfinite(x) for x in losses)
    assert sum(losses[-5:]) / 5 < 0.75 * sum(losses[:5]) / 5, losses
    assert end < 0.6 * start, (start, end)
    # The frozen base is untouched, bit for bit; every LoRA tensor moved.
    base_after = frozen(model)
    assert base_after.keys() == base_before.keys()
    assert all(torch.equal(base_before[n], base_after[n]) for n in base_before)
    lora_after = trainable(model)
    assert all(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)


# ---------------------------------------------------------------------------------------------- Trainer


@pytest.mark.parametrize("selection", ["random", "answer"])
def test_trainer_logged_loss_and_applied_gradient_are_the_selected_token_mean(tmp_path, selection):
    """Equal-length micro-batches, every position labelled: both micro-batches have the same counts, so the
    loss of the accumulated step is the plain mean of the two micro-batches' selected-token means."""
    model = tokentune_lora(token_ratio=0.4, seed=3, selection=selection)
    dataset = make_dataset(make_tokenizer(), lengths=[9, 9, 9, 9], seed=2)
    before, after, logged, calls, applied = run_one_step(tmp_path, model, dataset)

    assert_tokentune_was_active(calls)
    counts = [labelled_count(call["labels"]) for call in calls]
    assert counts[0] == counts[1] and all(int(call["num_items_in_batch"]) == sum(counts) for call in calls)
    selected = [int((call["mask"][:, :-1] & (call["labels"][:, 1:] != -100)).sum()) for call in calls]
    assert selected[0] == selected[1]

    load(model, before)
    means = selected_means(model, calls)
    expected = (means[0] + means[1]) / 2
    assert logged == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # Each micro-batch contributed half of its mean: never a doubled (or halved) loss.
    for call, mean in zip(calls, means):
        assert call["loss"].item() == pytest.approx(mean / 2, rel=1e-5, abs=1e-6)

    reference_loss, reference_grad = reference_step(model, calls, [0.5, 0.5])
    assert reference_loss == pytest.approx(expected, rel=1e-5)
    assert applied.keys() == reference_grad.keys()
    for name, grad in reference_grad.items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(applied[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        # SGD with lr=1: the update is exactly minus that gradient.
        torch.testing.assert_close(after[name] - before[name], -grad, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_all_tokens_selected_matches_the_token_mean_of_the_accumulated_batch(tmp_path):
    """token_ratio=1 with padding and unequal micro-batches: TokenTune must reproduce ordinary LoRA training,
    whose loss over an accumulated step is the mean over all labelled tokens of both micro-batches."""
    model = tokentune_lora(token_ratio=1.0, seed=4)
    dataset = make_dataset(make_tokenizer(), lengths=[4, 12, 6, 7], seed=5)
    before, after, logged, calls, applied = run_one_step(tmp_path, model, dataset)

    counts = [labelled_count(call["labels"]) for call in calls]
    assert counts[0] != counts[1]  # the test needs unequal micro-batches
    for call in calls:
        assert torch.equal(call["mask"], call["attention_mask"].bool())

    load(model, before)
    model.eval()
    total_ce = 0.0
    for call in calls:
        logits = model(input_ids=call["input_ids"], attention_mask=call["attention_mask"]).logits
        targets = call["labels"][:, 1:]
        total_ce = total_ce + torch.nn.functional.cross_entropy(
            logits[:, :-1].flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum"
        )
    token_mean = total_ce / sum(counts)
    assert logged == pytest.approx(token_mean.item(), rel=1e-5)
    model.zero_grad(set_to_none=True)
    token_mean.backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(applied[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
            torch.testing.assert_close(after[name] - before[name], -param.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_trainer_unequal_micro_batches_weight_each_mean_by_its_labelled_share(tmp_path):
    """Unequal micro-batches with a token subset: the loss is the documented estimate of the accumulated
    selected-token mean, sum_k mean_k * labelled_k / num_items_in_batch; logged and applied as such."""
    model = tokentune_lora(token_ratio=0.5, seed=6)
    dataset = make_dataset(make_tokenizer(), lengths=[4, 12, 6, 7], seed=5)
    before, after, logged, calls, applied = run_one_step(tmp_path, model, dataset)

    assert_tokentune_was_active(calls)
    assert any((call["attention_mask"] == 0).any() for call in calls)  # the collator padded
    counts = [labelled_count(call["labels"]) for call in calls]
    assert counts[0] != counts[1]
    # Trainer counted the labelled positions of both micro-batches of the step and passed them on.
    assert all(int(call["num_items_in_batch"]) == sum(counts) for call in calls)
    weights = [count / sum(counts) for count in counts]
    load(model, before)
    means = selected_means(model, calls)
    assert logged == pytest.approx(sum(w * m for w, m in zip(weights, means)), rel=1e-5)
    _, reference_grad = reference_step(model, calls, weights)
    for name, grad in reference_grad.items():
        torch.testing.assert_close(applied[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(after[name] - before[name], -grad, rtol=1e-4, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- processes


def _selected_mean_and_grad(model, batch, mask):
    inner = model.base_model.model
    model.eval()
    model.zero_grad(set_to_none=True)
    with reference_forward(inner, inner.model.layers, mask):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    loss = selected_causal_lm_loss(logits, batch["labels"], mask)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    model.train()
    return loss.detach(), grads


def _fixed_mask(batch, seed=0):
    generator = torch.Generator().manual_seed(seed)
    real = batch["attention_mask"].bool()
    mask = (torch.rand(real.shape, generator=generator) < 0.4) & real
    mask[:, -1] = True  # the last real token of every (left-padded) row
    return mask


@pytest.mark.parametrize(("as_tensor", "task_type"), [(True, "CAUSAL_LM"), (False, "CAUSAL_LM"), (True, None)])
def test_two_simulated_processes_do_not_double_the_loss(as_tensor, task_type):
    """Trainer with 2 processes passes num_items_in_batch counted over both and multiplies the loss by 2;
    DDP then averages the gradients. With identical counts on both processes the logged loss and the
    gradient must be the local selected-token mean, not twice it. Also without a task type (PEFT's plain
    PeftModel calls the base model directly)."""
    model = tokentune_lora(token_ratio=0.5, seed=7, task_type=task_type)
    batch = make_batch("llama", batch=3, length=10, seed=8)
    mask = _fixed_mask(batch)
    mean, mean_grad = _selected_mean_and_grad(model, batch, mask)

    local = labelled_count(batch["labels"])
    num_items = torch.tensor(2 * local) if as_tensor else 2 * local
    model.train()
    out = model(**batch, token_mask=mask, num_items_in_batch=num_items)
    assert torch.equal(model.base_model.last_token_mask, mask)
    trainer_loss = 2 * out.loss  # Trainer: loss *= num_processes (average_tokens_across_devices)
    torch.testing.assert_close(trainer_loss.detach(), mean, rtol=1e-5, atol=1e-6)
    assert not torch.isclose(trainer_loss.detach(), 2 * mean, rtol=1e-2)
    model.zero_grad(set_to_none=True)
    trainer_loss.backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            # Both processes hold this gradient; DDP's average of two equal gradients is itself.
            torch.testing.assert_close(param.grad, mean_grad[name], rtol=1e-4, atol=1e-6, msg=name)


def test_without_num_items_the_loss_is_exactly_the_selected_token_mean():
    model = tokentune_lora(token_ratio=0.5, seed=9)
    batch = make_batch("llama", batch=3, length=10, seed=10)
    mask = _fixed_mask(batch, seed=1)
    mean, mean_grad = _selected_mean_and_grad(model, batch, mask)

    model.train()
    out = model(**batch, token_mask=mask)
    torch.testing.assert_close(out.loss.detach(), mean, rtol=1e-6, atol=1e-6)
    out.loss.backward()
    for name, param in model.named_parameters():
        if param.requires_grad:
            torch.testing.assert_close(param.grad, mean_grad[name], rtol=1e-4, atol=1e-6, msg=name)
    # One process, one micro-batch: num_items_in_batch equal to the local count changes nothing.
    model.zero_grad(set_to_none=True)
    out = model(**batch, token_mask=mask, num_items_in_batch=torch.tensor(labelled_count(batch["labels"])))
    torch.testing.assert_close(out.loss.detach(), mean, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- bf16


def test_bf16_autocast_on_cpu_is_close_to_fp32():
    model = tokentune_lora(token_ratio=0.5, seed=13)
    batch = make_batch("llama", batch=3, length=10, seed=14)
    mask = _fixed_mask(batch, seed=3)
    fp32_loss, fp32_grads = _selected_mean_and_grad(model, batch, mask)  # the fp32 definition

    model.train()
    dtypes = []
    head = model.get_base_model().get_output_embeddings()
    handle = head.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**batch, token_mask=mask)
    handle.remove()
    assert dtypes and set(dtypes) == {torch.bfloat16}  # autocast really ran the model (and its LM head) in bf16
    assert torch.equal(model.base_model.last_token_mask, mask)  # a TokenTune training forward
    out.loss.backward()
    assert out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss.detach(), fp32_loss, rtol=3e-2, atol=3e-2)
    flat = torch.cat([p.grad.flatten() for n, p in model.named_parameters() if p.requires_grad])
    flat32 = torch.cat([fp32_grads[n].flatten() for n, p in model.named_parameters() if p.requires_grad])
    assert torch.isfinite(flat).all() and flat.abs().sum() > 0
    assert torch.nn.functional.cosine_similarity(flat, flat32, dim=0) > 0.95
    # The parameters themselves stay fp32 (LoRA) / untouched (base).
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_trainer_bf16_on_cpu(tmp_path):
    model = tokentune_lora(token_ratio=0.5, seed=15)
    lora_before = trainable(model)
    calls = run_two_steps(tmp_path, model, dataset_seed=16, bf16=True)
    assert all(call["autocast"] for call in calls)  # Trainer ran the forwards under bf16 autocast
    assert_tokentune_was_active(calls)
    lora_after = trainable(model)
    assert all(not torch.equal(lora_before[n], lora_after[n]) for n in lora_before)
    assert all(torch.isfinite(p).all() for p in lora_after.values())
