"""TRL: SFTTrainer with TokenTune / SlimFit models, exactly; DPO and other TRL trainers refused with token selection.

Every SFT case runs one optimizer step (2 micro-batches, SGD with lr=1) and checks the loss TRL logs, the gradient
it applies and its entropy / token-accuracy metrics against an independent recomputation (tests/helpers/trl_cases.py):
each micro-batch's selected-token mean over labelled positions, weighted by its share of the step's labelled
positions, with the gradient by the equivalent definition of methods.md.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tiny_models import LORA_TARGETS, build, trainer_kwargs
from helpers.trl_cases import (
    documents,
    load,
    reference_step,
    run_sft_step,
    sft_args,
    sft_dataset,
    sft_tokenizer,
    trainable,
)
from peft import LoraConfig, get_peft_model

from peft_slim import (
    SlimFitCallback,
    SlimFitConfig,
    TokenSelectionConfig,
    TokenTuneCallback,
    TokenTuneConfig,
)

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")  # installed with trl


def _lora(**fields) -> LoraConfig:
    return LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=LORA_TARGETS["llama"], **fields)


def tokentune(seed: int = 0, **fields):
    fields.setdefault("token_ratio", 0.5)
    fields.setdefault("seed", seed)
    config = TokenTuneConfig(task_type="CAUSAL_LM", lora=_lora(init_lora_weights=False), **fields)
    return get_peft_model(build("llama", seed=seed), config)


def slimfit_tokentune(seed: int = 0, **selection):
    config = SlimFitConfig(
        task_type="CAUSAL_LM",
        lora=_lora(init_lora_weights=False),
        freeze_ratio=0.5,
        activation_compression=None,
        token_selection=TokenSelectionConfig(token_ratio=0.5, seed=seed, **selection),
        seed=seed,
    )
    return get_peft_model(build("llama", seed=seed), config)


def check_step(trainer, logged, calls, applied, before, autocast=False, rel=1e-5):
    """Logged loss, applied gradient and metrics against the reference, on the weights before the step."""
    peft_model = trainer.model
    assert len(calls) == 2, "expected two training micro-batches"
    for call in calls:
        real = sum(span.stop - span.start for _, span in documents(call["inputs"]))
        assert 0 < int(call["mask"].sum()) < real, "token selection was not active"
    after = trainable(peft_model)
    load(peft_model, before)
    expected, grads, entropy, accuracy = reference_step(peft_model, calls, autocast=autocast)
    load(peft_model, after)
    assert logged["loss"] == pytest.approx(expected, rel=rel, abs=1e-6)
    assert logged["entropy"] == pytest.approx(entropy, rel=rel, abs=1e-5)
    assert logged["mean_token_accuracy"] == pytest.approx(accuracy, rel=rel, abs=1e-6)
    assert applied and set(applied) <= set(grads)
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-4, atol=1e-6)
    for name, grad in applied.items():
        torch.testing.assert_close(grad, grads[name], **tol, msg=name)
    # lr=1 SGD: every trained tensor moved by exactly its applied gradient.
    for name, grad in applied.items():
        torch.testing.assert_close(after[name], before[name] - grad, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------- SFTTrainer


@pytest.mark.parametrize(
    "data, overrides",
    [
        ("text", {}),
        ("completion", {}),  # completion_only_loss: TRL's default for prompt-completion data
        ("chat", {"assistant_only_loss": True}),
        ("completion", {"packing": True, "max_length": 20}),  # padding-free: position_ids, no attention_mask
    ],
    ids=["plain", "completion_only", "assistant_only", "packing"],
)
@pytest.mark.parametrize("selection", ["random", "answer"])
def test_sft_tokentune_lora_is_exact(tmp_path, data, overrides, selection):
    model = tokentune(seed=1, selection=selection)
    with pytest.warns(UserWarning, match=r"mean_token_accuracy.*selected labelled positions") as caught:
        trainer, logged, calls, applied, before = run_sft_step(
            tmp_path, sft_dataset(data, n=12 if "packing" in overrides else 4, seed=2), model=model, **overrides
        )
    assert sum("selected labelled positions" in str(w.message) for w in caught) == 1  # once per model
    inputs = calls[0]["inputs"]
    if data != "text":  # completion / assistant masks reached the labels: some real positions carry none
        assert (inputs["labels"] == -100).any() and (inputs["labels"] != -100).any()
    if "packing" in overrides:
        assert "attention_mask" not in inputs and "position_ids" in inputs
        assert any(len([d for d in documents(call["inputs"])]) > 1 for call in calls), "nothing was packed"
    check_step(trainer, logged, calls, applied, before)


def test_sft_slimfit_tokentune_is_exact(tmp_path):
    check_step(
        *run_sft_step(tmp_path, sft_dataset("completion", seed=5), model=slimfit_tokentune(seed=4, selection="answer"))
    )


@pytest.mark.parametrize("method", ["tokentune", "slimfit"])
def test_sft_with_peft_config_builds_the_model(tmp_path, method):
    """TRL accepts any PeftConfig: SFTTrainer(model=base, peft_config=...) wraps the model itself."""
    lora = _lora()
    if method == "tokentune":
        config = TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, seed=0, lora=lora)
    else:
        selection = TokenSelectionConfig(token_ratio=0.5, seed=0, selection="answer")
        config = SlimFitConfig(
            task_type="CAUSAL_LM", lora=lora, freeze_ratio=0.5, activation_compression=None, token_selection=selection
        )
    result = run_sft_step(
        tmp_path, sft_dataset("completion", seed=6), model=build("llama", seed=6), peft_config=config
    )
    trainer = result[0]
    assert (
        type(trainer.model.base_model).__name__ == {"tokentune": "TokenTuneModel", "slimfit": "SlimFitModel"}[method]
    )
    check_step(*result)


def test_sft_gradient_accumulation_weights_micro_batches_by_labelled_share(tmp_path):
    """Unequal micro-batches (different completion lengths): the step is the labelled-share-weighted sum of the
    micro-batch means, not their plain average; checked by the reference and by hand."""
    trainer, logged, calls, applied, before = run_sft_step(
        tmp_path,
        sft_dataset("completion", n=4, seed=8),
        model=tokentune(seed=8, selection="answer"),
        per_device_train_batch_size=1,
        gradient_accumulation_steps=2,
    )
    counts = [int((call["inputs"]["labels"][:, 1:] != -100).sum()) for call in calls]
    assert counts[0] != counts[1], "the micro-batches should differ in labelled count"
    check_step(trainer, logged, calls, applied, before)


def test_sft_bf16_autocast_on_cpu(tmp_path):
    trainer, logged, calls, applied, before = run_sft_step(
        tmp_path, sft_dataset("completion", seed=9), model=tokentune(seed=9), bf16=True
    )
    check_step(trainer, logged, calls, applied, before, autocast=True, rel=2e-2)


def test_sft_slimfit_without_token_selection_is_trls_own_loss(tmp_path):
    """No token selection: TRL's fused head runs unchanged; its loss is the plain completion-only mean."""
    lora = _lora(init_lora_weights=False)
    config = SlimFitConfig(task_type="CAUSAL_LM", lora=lora, freeze_ratio=0.5, activation_compression=None, seed=0)
    model = get_peft_model(build("llama", seed=10), config)
    trainer, logged, calls, _, before = run_sft_step(
        tmp_path, sft_dataset("completion", seed=10), model=model, selects=False
    )
    load(model, before)
    model.eval()
    means, counts = [], []
    with torch.no_grad():
        for call in calls:
            inputs = call["inputs"]
            logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
            targets = inputs["labels"][:, 1:]
            ce = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten(), reduction="sum")
            means.append(ce.item())
            counts.append(int((targets != -100).sum()))
    assert logged["loss"] == pytest.approx(sum(means) / sum(counts), rel=1e-5)


def test_sft_leaves_the_callers_batch_unchanged(tmp_path):
    """TokenTune's hook takes `labels` out of its own copy of the keyword arguments, never out of TRL's batch."""
    seen = []

    class Watching(trl.SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            labels = inputs["labels"].clone()
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            seen.append(torch.equal(inputs["labels"], labels))
            return loss

    trainer = Watching(
        model=tokentune(seed=11),
        args=sft_args(tmp_path),
        train_dataset=sft_dataset("completion", seed=11),
        processing_class=sft_tokenizer(),
        callbacks=[TokenTuneCallback()],
    )
    trainer.train()
    assert seen == [True, True]

    model = tokentune(seed=11)
    batch = {"input_ids": torch.randint(4, 90, (2, 7)), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    batch["labels"] = batch["input_ids"].clone()
    snapshot = {k: v.clone() for k, v in batch.items()}
    model.train()
    model(**batch).loss.backward()
    assert batch.keys() == snapshot.keys() and all(torch.equal(batch[k], snapshot[k]) for k in batch)


def test_sft_dft_loss_is_refused_before_any_update(tmp_path):
    model = tokentune(seed=12)
    before = trainable(model)
    with pytest.raises(ValueError, match=r"loss_type='dft' is not supported with token selection"):
        run_sft_step(tmp_path, sft_dataset("completion", seed=12), model=model, loss_type="dft")
    after = trainable(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


def test_eval_uses_every_position(tmp_path):
    """Eval (no gradients): TokenTune is inactive and TRL's fused head scores every labelled position."""
    model = tokentune(seed=13)
    dataset = sft_dataset("completion", seed=13)
    trainer = trl.SFTTrainer(
        model=model,
        args=sft_args(tmp_path, per_device_eval_batch_size=4),
        train_dataset=dataset,
        eval_dataset=dataset,
        processing_class=sft_tokenizer(),
    )
    metrics = trainer.evaluate()
    batch = next(iter(trainer.get_eval_dataloader()))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = batch["labels"][:, 1:]
    expected = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten())
    assert metrics["eval_loss"] == pytest.approx(expected.item(), rel=1e-5)


# ---------------------------------------------------------------------------------------------- refused


def preference_dataset(n: int = 4, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def words(count):
        return " ".join(f"w{int(i)}" for i in torch.randint(6, 90, (count,), generator=generator))

    return datasets.Dataset.from_dict(
        {
            "prompt": [words(4) for _ in range(n)],
            "chosen": [" " + words(3) for _ in range(n)],
            "rejected": [" " + words(3) for _ in range(n)],
        }
    )


# TRL's own defaults where trainer_kwargs differs: one micro-batch a step, seed 42.
TRL_DEFAULTS = dict(gradient_accumulation_steps=1, seed=42)


def dpo_args(tmp_path, **overrides):
    args = trainer_kwargs(tmp_path, **TRL_DEFAULTS, bf16=False, max_steps=1, max_length=32)
    return trl.DPOConfig(**args | overrides)


@pytest.mark.parametrize("how", ["tokentune", "slimfit_tokentune", "peft_config"])
def test_dpo_with_token_selection_is_refused_before_any_update(tmp_path, how):
    """DPOTrainer adds a reference copy ('ref') of a ready PeftModel's adapter (a second adapter of the same method),
    none with peft_config=: either way the first training forward refuses token selection, saying why."""
    if how == "peft_config":
        lora = LoraConfig(r=4, target_modules=LORA_TARGETS["llama"])
        model, config = build("llama", seed=15), TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, lora=lora)
    else:
        model, config = {"tokentune": tokentune, "slimfit_tokentune": slimfit_tokentune}[how](seed=14), None
    trainer = trl.DPOTrainer(
        model=model,
        args=dpo_args(tmp_path),
        train_dataset=preference_dataset(seed=14),
        processing_class=sft_tokenizer(),
        peft_config=config,
        callbacks=[TokenTuneCallback()],  # tells the model which trainer trains it
    )
    assert sorted(trainer.model.peft_config) == (["default"] if config else ["default", "ref"])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=r"DPOTrainer is not supported with token selection.*plain LoRA adapter"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())


def test_dpo_with_a_ready_slimfit_model_trains_against_its_reference_adapter(tmp_path):
    """A ready SlimFit + LoRA model: TRL's reference adapter 'ref' is a copy of 'default', so at step 0 (policy =
    reference) the DPO loss TRL logs is -log(sigmoid(0)) = log 2, though LoRA B is not zero; 'ref' stays as it was."""
    lora = _lora(init_lora_weights=False)
    config = SlimFitConfig(task_type="CAUSAL_LM", lora=lora, freeze_ratio=0.5, activation_compression=None, seed=0)
    model = get_peft_model(build("llama", seed=16), config)
    initial = trainable(model)
    trainer = trl.DPOTrainer(
        model=model,
        args=dpo_args(tmp_path, learning_rate=1e-2, max_steps=2),
        train_dataset=preference_dataset(seed=16),
        processing_class=sft_tokenizer(),
        callbacks=[SlimFitCallback()],
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)
    weights = dict(trainer.model.named_parameters())
    for name, value in initial.items():
        assert torch.equal(weights[name.replace(".default.", ".ref.")], value)  # the reference never trains
    assert any(not torch.equal(weights[name], value) for name, value in initial.items())  # the policy did


def test_dpo_with_slimfit_and_a_ref_model_runs_trls_own_objective(tmp_path):
    """SlimFit without token selection leaves the forward exact: at step 0 (LoRA B = 0, policy = reference) the
    DPO loss TRL logs is -log(sigmoid(0)) = log 2."""
    lora = _lora()
    config = SlimFitConfig(task_type="CAUSAL_LM", lora=lora, freeze_ratio=0.5, activation_compression=None, seed=0)
    model = get_peft_model(build("llama", seed=16), config)
    trainer = trl.DPOTrainer(
        model=model,
        ref_model=build("llama", seed=16),
        args=dpo_args(tmp_path, learning_rate=1e-3),
        train_dataset=preference_dataset(seed=16),
        processing_class=sft_tokenizer(),
    )
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged[0]["loss"] == pytest.approx(math.log(2), rel=1e-5)


def test_sft_with_token_selection_without_the_callback_is_refused_before_any_update(tmp_path):
    """Only TokenTuneCallback tells the model which trainer calls its fused head: without it SFTTrainer's first
    training forward is refused, naming the callback; with it (run_sft_step) the step is exact; after training the
    model forgets the trainer again."""
    model = tokentune(seed=19)
    before = trainable(model)
    trainer = trl.SFTTrainer(
        model=model,
        args=sft_args(tmp_path),
        train_dataset=sft_dataset("completion", seed=19),
        processing_class=sft_tokenizer(),
    )
    with pytest.raises(
        ValueError, match=r"^TokenTune: pass `callbacks=\[peft_slim.TokenTuneCallback\(\)\]` to trl.SFTTrainer"
    ):
        trainer.train()
    assert all(torch.equal(before[n], value) for n, value in trainable(model).items())
    with pytest.warns(UserWarning, match="selected labelled positions"):
        run_sft_step(tmp_path / "with", sft_dataset("completion", seed=19), model=model)
    assert model.base_model.token_selector.trainer_args is None


def test_fused_head_outside_sft_trainer_is_refused():
    """Any other caller of TRL's fused head (a custom loop, another Trainer) gets the same clear error."""
    model = tokentune(seed=15)
    trl.trainer.utils.add_fused_lm_head(model.get_base_model())
    ids = torch.randint(4, 90, (2, 6))
    model.train()
    with pytest.raises(
        ValueError, match=r"^TokenTune: pass `callbacks=\[peft_slim.TokenTuneCallback\(\)\]` to trl.SFTTrainer"
    ) as refused:
        model(input_ids=ids, labels=ids, fused_lm_head=True)
    assert str(refused.value).count(". ") == 1  # two sentences, the fix first
    # Eval mode: token selection is inactive and TRL's own fused head answers, every position scored.
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, fused_lm_head=True)
        logits = model(input_ids=ids).logits
    expected = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(out.log_probs, expected, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- answer selection


def _answer_positions(dataset, kind: str) -> dict[tuple, set[int]]:
    """Token ids of each example -> positions t whose next token is part of the answer, from the raw example.

    Prompt-completion: the completion (and the EOS TRL appends) starts at P = len(prompt ids), so t runs from
    P - 1 to the last-but-one token. Chat: t such that token t + 1 is in the template's assistant mask.
    """
    tokenizer = sft_tokenizer()
    found = {}
    for example in dataset:
        if kind == "completion":
            prompt = tokenizer(example["prompt"])["input_ids"]
            ids = prompt + tokenizer(example["completion"])["input_ids"] + [tokenizer.eos_token_id]
            answer = set(range(len(prompt) - 1, len(ids) - 1))
        else:
            out = tokenizer.apply_chat_template(
                example["messages"], tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids, mask = out["input_ids"], out["assistant_masks"]
            answer = {t for t in range(len(ids) - 1) if mask[t + 1]}
        found[tuple(ids)] = answer
    return found


@pytest.mark.parametrize(
    "kind, overrides, budget",
    [("completion", {}, 11), ("chat", {"assistant_only_loss": True}, 14)],
    ids=["completion_only", "assistant_only"],
)
def test_answer_selection_takes_the_answer_under_sft(tmp_path, kind, overrides, budget):
    """With a budget that holds the answer, every answer position is selected; with a smaller one, nothing else
    (besides the always-selected first and last tokens). The answer is derived from the raw examples."""
    dataset = sft_dataset(kind, n=4, seed=17)
    answers = _answer_positions(dataset, kind)
    for index, num_tokens in enumerate([budget, 4]):
        model = tokentune(seed=17, selection="answer", token_ratio=None, num_tokens=num_tokens)
        _, _, calls, _, _ = run_sft_step(tmp_path / str(index), dataset, model=model, **overrides)
        for call in calls:
            ids, attention, mask = call["inputs"]["input_ids"], call["inputs"]["attention_mask"], call["mask"]
            for row in range(ids.shape[0]):
                length = int(attention[row].sum())
                answer = answers[tuple(ids[row, :length].tolist())]
                selected = set(mask[row].nonzero().flatten().tolist()) - {0, length - 1}
                assert answer and max(answer) <= length - 2
                if num_tokens == budget:
                    assert len(answer) + 2 <= num_tokens and answer <= selected
                else:
                    assert len(answer) + 2 > num_tokens and selected <= answer and selected


# ---------------------------------------------------------------------------------------------- GRPO


def _grpo(tmp_path, model, peft_config=None, **overrides):
    args = trainer_kwargs(
        tmp_path, **TRL_DEFAULTS, logging_steps=10, bf16=False, num_generations=2, max_completion_length=4, max_steps=1
    )
    return trl.GRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **kwargs: [float(len(c)) for c in completions],
        args=trl.GRPOConfig(**args | overrides),
        train_dataset=datasets.Dataset.from_dict({"prompt": ["w6 w7 w8", "w9 w10 w11"] * 2}),
        processing_class=sft_tokenizer(),
        peft_config=peft_config,
        callbacks=[TokenTuneCallback()] if peft_config is not None else None,
    )


def test_grpo_with_token_selection_is_refused(tmp_path):
    config = TokenTuneConfig(
        task_type="CAUSAL_LM", token_ratio=0.5, lora=LoraConfig(r=4, target_modules=LORA_TARGETS["llama"])
    )
    trainer = _grpo(tmp_path / "a", build("llama", seed=18), peft_config=config)
    before = trainable(trainer.model)
    with pytest.raises(ValueError, match=r"GRPOTrainer is not supported with token selection"):
        trainer.train()
    assert all(torch.equal(before[n], value) for n, value in trainable(trainer.model).items())
    # A ready model with a KL term: GRPOTrainer adds a reference copy of the adapter; training is refused the same.
    trainer = _grpo(tmp_path / "b", tokentune(seed=18), beta=0.1)
    assert sorted(trainer.model.peft_config) == ["default", "ref"]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match=r"[Ff]or DPO, GRPO and the other TRL trainers train a LoRA adapter without"):
        trainer.train()
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
