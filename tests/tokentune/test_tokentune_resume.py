"""The token-selection generator in Trainer checkpoints: a resumed run selects and trains as an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from helpers.slimfit_cases import slimfit_model
from helpers.tiny_models import make_batch
from helpers.tokentune_cases import tokentune_model
from helpers.trainer_cases import STEPS, selection_trainer, tokentune_llama

import peft_slim.tokentune.callback as callback_module
from peft_slim import TokenSelectionConfig, TokenTuneCallback
from peft_slim.tokentune import find_token_selector

SAVE_AT = 3


class MaskRecorder:
    """TokenTune's selection of every training forward of ``model``, in order."""

    def __init__(self, model):
        self.masks: list[torch.Tensor] = []
        model.register_forward_hook(self._record)
        self.model = model

    def _record(self, module, args, output):
        if module.training and torch.is_grad_enabled():
            self.masks.append(self.model.base_model.last_token_mask.clone())


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("restore_callback_states", [False, True])
def test_resumed_trainer_run_selects_and_trains_as_an_uninterrupted_one(tmp_path, restore_callback_states):
    straight = tokentune_llama()
    straight_masks = MaskRecorder(straight)
    selection_trainer(tmp_path / "straight", straight, [TokenTuneCallback()]).train()
    assert len(straight_masks.masks) == STEPS

    first = tokentune_llama()
    first_masks = MaskRecorder(first)
    run = tmp_path / "run"
    selection_trainer(run, first, [TokenTuneCallback()], save_strategy="steps", save_steps=SAVE_AT).train()
    assert all(torch.equal(a, b) for a, b in zip(first_masks.masks, straight_masks.masks))
    saved = json.loads((run / f"checkpoint-{SAVE_AT}" / "trainer_state.json").read_text())
    assert saved["stateful_callbacks"]["TokenTuneCallback"]["attributes"]["generator_states"]

    resumed = tokentune_llama()  # a fresh model: its generator starts from the seed again
    resumed_masks = MaskRecorder(resumed)
    trainer = selection_trainer(
        run, resumed, [TokenTuneCallback()], restore_callback_states_from_checkpoint=restore_callback_states
    )
    trainer.train(resume_from_checkpoint=str(run / f"checkpoint-{SAVE_AT}"))

    assert len(resumed_masks.masks) == STEPS - SAVE_AT
    for step, (mask, expected) in enumerate(zip(resumed_masks.masks, straight_masks.masks[SAVE_AT:]), SAVE_AT + 1):
        assert torch.equal(mask, expected), f"step {step} selected other tokens than the uninterrupted run"
    expected_weights = _weights(straight)
    for name, value in _weights(resumed).items():
        torch.testing.assert_close(value, expected_weights[name], rtol=0, atol=1e-6, msg=name)


def test_resuming_a_checkpoint_without_the_state_warns(tmp_path):
    run = tmp_path / "run"
    selection_trainer(run, tokentune_llama(), save_strategy="steps", save_steps=SAVE_AT).train()
    with pytest.warns(UserWarning, match="without the token-selection state"):
        selection_trainer(run, tokentune_llama(), [TokenTuneCallback()]).train(
            resume_from_checkpoint=str(run / f"checkpoint-{SAVE_AT}")
        )


def test_callback_needs_token_selection(tmp_path):
    plain = slimfit_model("llama", lora=True, freeze_ratio=0.5)  # SlimFit without `token_selection`
    with pytest.raises(ValueError, match="TokenTuneCallback: the Trainer's model has no token selection"):
        selection_trainer(tmp_path, plain, [TokenTuneCallback()], max_steps=1).train()


def test_callback_finds_slimfit_token_selection():
    model = slimfit_model("llama", freeze_ratio=0.5, token_selection=TokenSelectionConfig(token_ratio=0.5, seed=0))
    assert find_token_selector(model) is model.base_model.token_selector is not None


# ---------------------------------------------------------------------------------------------- the selector's state


def test_selector_state_dict_round_trip():
    model = tokentune_model("llama")
    selector = find_token_selector(model)
    batch = make_batch("llama")
    model.train()
    model(**batch)
    state = selector.state_dict()
    model(**batch)
    after = model.base_model.last_token_mask.clone()
    model(**batch)  # the generator moves on
    selector.load_state_dict(state)
    model(**batch)
    assert torch.equal(model.base_model.last_token_mask, after)


@pytest.mark.parametrize(
    "state",
    [{}, {"generator_state": [1, 2]}, {"generator_state": torch.zeros(3, dtype=torch.uint8)}, {"other": 1}, None],
    ids=["empty", "list", "short", "unknown_key", "none"],
)
def test_selector_load_state_dict_refuses_other_values(state):
    selector = find_token_selector(tokentune_model("llama"))
    with pytest.raises(ValueError, match="load_state_dict"):
        selector.load_state_dict(state)


def test_callback_state_under_two_processes(monkeypatch):
    """Under several processes each rank's generator state is gathered, and each rank restores its own."""
    ranks = [tokentune_model("llama", seed=0), tokentune_model("llama", seed=1)]
    selectors = [find_token_selector(model) for model in ranks]
    callbacks = [TokenTuneCallback(), TokenTuneCallback()]
    monkeypatch.setattr(callback_module, "_world_size", lambda: 2)
    encoded = [callback_module._encode(selector) for selector in selectors]

    def all_gather_object(output, obj):
        output[:] = encoded

    monkeypatch.setattr(callback_module.dist, "all_gather_object", all_gather_object)

    class State:
        global_step = 0
        stateful_callbacks: dict = {}

    class Args:
        save_strategy = "steps"

    for rank, (callback, model) in enumerate(zip(callbacks, ranks)):
        monkeypatch.setattr(callback_module, "rank", lambda rank=rank: rank)
        callback.on_train_begin(Args(), State(), None, model=model)
        callback.on_step_end(Args(), State(), None)
    saved = callbacks[0].state()["attributes"]["generator_states"]
    assert saved == encoded

    # Resume: each rank restores its own entry, the two generators stay different.
    for rank, selector in enumerate(selectors):
        selector.generator.manual_seed(123)  # moved on / fresh
        monkeypatch.setattr(callback_module, "rank", lambda rank=rank: rank)
        callback = TokenTuneCallback()
        callback.generator_states = saved
        callback.on_train_begin(Args(), State(), None, model=ranks[rank])
        assert callback_module._encode(selector) == encoded[rank]
