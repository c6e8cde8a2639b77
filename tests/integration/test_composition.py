"""peft_slim beside the ecosystem's other memory tools and non-transformers models: exact, or refused at once.

References are independent: the plain base model's forward, vanilla PEFT LoRA, autograd on a plain copy, and a
fresh bitsandbytes optimizer's first update.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from helpers.slimfit_cases import loss_of, slimfit_model
from helpers.tiny_models import build, decoder_config, make_batch
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.autograd.graph import save_on_cpu
from transformers import MixtralConfig, MixtralForCausalLM

from peft_slim import (
    ActivationCompressionConfig,
    SlimFitConfig,
    TokenSelectionConfig,
    TokenTuneConfig,
    slimfit_,
    tokentune_,
)
from peft_slim.token_selection.blocks import find_blocks
from peft_slim.tuner import model_kinds


def _tokentune(base, compression=None, **fields):
    torch.manual_seed(1)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    config = TokenTuneConfig(
        task_type="CAUSAL_LM", token_ratio=0.5, lora=lora, activation_compression=compression, **fields
    )
    return get_peft_model(base, config).train()


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.requires_grad and p.grad is not None]


# ------------------------------------------------------------------------------------------------ DeepSpeed ZeRO-3
def _apply(model: nn.Module, config):
    """``config`` on ``model``: through PEFT with `lora`, else the method's full fine-tuning transform."""
    if config.lora is not None:
        return get_peft_model(model, config)
    return (slimfit_ if isinstance(config, SlimFitConfig) else tokentune_)(model, config)


def _zero3_sharded(model: nn.Module) -> nn.Module:
    """What DeepSpeed ZeRO-3 leaves before PEFT sees the model: each parameter an empty tensor with ds_* fields."""
    for index, param in enumerate(model.parameters()):
        param.ds_id, param.ds_status, param.ds_shape = index, "NOT_AVAILABLE", tuple(param.shape)
        param.data = torch.empty(0, dtype=param.dtype)
    return model


@pytest.mark.parametrize(
    "config",
    [
        lambda: TokenTuneConfig(
            task_type="CAUSAL_LM", token_ratio=0.5, lora=LoraConfig(r=2, target_modules="all-linear")
        ),
        lambda: SlimFitConfig(task_type="CAUSAL_LM", freeze_ratio=0.5),
    ],
    ids=["tokentune", "slimfit"],
)
def test_zero3_is_refused_naming_what_works(config):
    with pytest.raises(ValueError, match=r"ZeRO-3 \(\d+ parameters partitioned.*FSDP2.*DDP.*ZeRO-1/2"):
        _apply(_zero3_sharded(build("llama")), config())


def test_zero3_enabled_in_transformers_is_refused(monkeypatch):
    monkeypatch.setattr(model_kinds, "is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(ValueError, match="ZeRO-3 is enabled"):
        slimfit_(build("llama"), SlimFitConfig(freeze_ratio=0.5))


# ------------------------------------------------------------------------------------- nested saved-tensor hooks
def _trl_offloading(monkeypatch):
    """TRL's ``OffloadActivations`` (what ``SFTConfig(activation_offloading=True)`` enters around each step),
    made on a CPU: it asks for an accelerator, so the CPU stands in for one (its "offload" is then a no-op move)."""
    offload = pytest.importorskip("trl.models.activation_offloading")
    if torch.accelerator.current_accelerator() is None:
        monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cpu"))
        monkeypatch.setattr(torch.cpu, "empty_cache", lambda: None, raising=False)
    return offload.OffloadActivations(use_pin_memory=False, use_streams=False)


@pytest.mark.parametrize("outer", ["save_on_cpu", "trl"])
def test_compression_inside_another_saved_tensor_hook_is_refused(outer, monkeypatch):
    """Only the innermost hook acts: the tuner's compression would take every tensor and the offloading none."""
    model = _tokentune(build("llama"), ActivationCompressionConfig(bits=8))
    hook = save_on_cpu() if outer == "save_on_cpu" else _trl_offloading(monkeypatch)
    with hook, pytest.raises(ValueError, match="inside another saved-tensor hook .*(save_on_cpu|OffloadActivations)"):
        model(**make_batch("llama", batch=2, length=16))
    model(**make_batch("llama", batch=2, length=16)).loss.backward()  # outside it: trains, no hook left behind


def test_trl_activation_offloading_without_compression_is_exact(monkeypatch):
    """TRL's offloading around a TokenTune forward (what SFTConfig(activation_offloading=True) does) acts on every
    saved tensor and gives the gradients of the same forward without it."""
    batch = make_batch("llama", batch=2, length=16)
    base = build("llama")
    plain = _tokentune(copy.deepcopy(base))
    plain(**batch).loss.backward()
    offloaded = _tokentune(base)
    offloading = _trl_offloading(monkeypatch)
    with offloading:
        loss = offloaded(**batch, token_mask=plain.base_model.last_token_mask).loss
    assert offloading.tensor_id > 0  # it saw the saved tensors
    loss.backward()
    for a, b in zip(_grads(plain), _grads(offloaded), strict=True):
        assert torch.equal(a, b)


def test_transformers_checkpoint_offload_is_exact(monkeypatch):
    """``activation_checkpointing_enable(offload=True)`` runs each checkpoint inside ``save_on_cpu`` (pinned, so
    accelerator-only: pinning is turned off here); under TokenTune the gradients are those without checkpointing,
    and with compression the offload is the innermost hook inside the layers (allowed: both act). TokenTune's
    one-forward step recomputes its blocks itself and checkpoints nothing, so the offload acts only where a block
    draws random numbers (here a no-op draw in the first block's MLP)."""
    import transformers.modeling_utils as modeling

    calls = []

    def unpinned(pin_memory=False, device_type="cuda"):
        calls.append(device_type)
        return save_on_cpu(pin_memory=False, device_type=device_type)

    monkeypatch.setattr(modeling, "save_on_cpu", unpinned)
    batch = make_batch("llama", batch=2, length=16)
    base = build("llama")
    for compression in (None, ActivationCompressionConfig(bits=None)):
        plain = _tokentune(copy.deepcopy(base), compression)
        plain(**batch).loss.backward()
        checkpointed = _tokentune(copy.deepcopy(base), compression)
        checkpointed.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}, offload=True
        )
        _, blocks = find_blocks(checkpointed.get_base_model())
        draw = blocks[0].mlp.register_forward_hook(lambda module, args, output: torch.rand(1) * 0 + output)
        calls.clear()
        with pytest.warns(UserWarning, match="draws random numbers"):
            checkpointed(**batch, token_mask=plain.base_model.last_token_mask).loss.backward()
        draw.remove()
        assert calls
        for a, b in zip(_grads(plain), _grads(checkpointed), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------- bitsandbytes optimizers
def test_bnb_8bit_adamw_restarts_a_released_unit_like_a_fresh_optimizer():
    """SlimFit frees a frozen unit's state; when it trains again its update is a fresh AdamW8bit's first update."""
    bnb = pytest.importorskip("bitsandbytes")
    model = slimfit_model("llama", freeze_ratio=0.8)
    params = [p for p in model.parameters() if p.requires_grad]
    make = functools.partial(bnb.optim.AdamW8bit, lr=1e-2, weight_decay=0.1)
    optimizer = make(params)
    model.slimfit_attach(optimizer)
    seen, restarts = set(), 0
    model.train()
    for step in range(8):
        loss_of(model, make_batch("llama", seed=step)).backward()
        fresh = [
            (p, p.detach().clone(), p.grad.clone()) for p in params if p.grad is not None and p not in optimizer.state
        ]
        optimizer.step()
        for param, before, grad in fresh:
            restarts += id(param) in seen
            seen.add(id(param))
            copy_ = nn.Parameter(before)
            copy_.grad = grad
            make([copy_]).step()
            assert torch.equal(param.detach(), copy_.detach())
        optimizer.zero_grad()
        model.slimfit_step()
    assert restarts > 0  # some unit's state was freed and rebuilt


class FakePagedAdamW(torch.optim.AdamW):
    """bitsandbytes' paged optimizers' marker (``is_paged``) on torch's AdamW, for machines without paging."""

    is_paged = True


@pytest.mark.parametrize("release", [True, False])
def test_paged_optimizer_with_state_release_is_refused_at_its_first_step(release):
    model = slimfit_model("llama", freeze_ratio=0.8, release_frozen_optimizer_state=release)
    optimizer = FakePagedAdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    before = [p.detach().clone() for p in model.parameters()]
    model.train()
    loss_of(model, make_batch("llama")).backward()
    if not release:  # the state is kept: nothing to free, so it works
        optimizer.step()
        return
    with pytest.raises(ValueError, match="FakePagedAdamW.*paged.*AdamW8bit.*release_frozen_optimizer_state=False"):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # refused before any update


def test_real_bnb_paged_adamw_is_refused():
    bnb = pytest.importorskip("bitsandbytes")
    model = slimfit_model("llama", freeze_ratio=0.8)
    optimizer = bnb.optim.PagedAdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    model.train()
    loss_of(model, make_batch("llama")).backward()
    with pytest.raises(ValueError, match="PagedAdamW8bit"):
        optimizer.step()


# ------------------------------------------------------------------------ outputs of a TokenTune training forward
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions", "output_router_logits"])
@pytest.mark.parametrize("where", ["call", "config"])
def test_per_layer_outputs_in_training_are_refused_naming_the_flag(flag, where):
    base = build("llama", attn_implementation="eager")
    batch = make_batch("llama", batch=2, length=12)
    if where == "config":  # (set before wrapping: transformers allows output_attentions on an eager config only)
        setattr(base.config, flag, True)
        named = f"model.config.{flag}=True"
    else:
        batch[flag] = True
        named = f"{flag}=True"
    model = _tokentune(base)
    with pytest.raises(ValueError, match=f"{flag.removeprefix('output_')} in a training forward \\({named}\\)"):
        model(**batch)


def test_router_logits_of_a_mixture_of_experts_are_refused_in_training():
    """A mixture-of-experts model asked for router logits adds their load-balancing loss to its loss: token
    selection's loss left it out (and its router logits, from the no-grad pass, carried no gradient), silently."""
    config = decoder_config(MixtralConfig, num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
    torch.manual_seed(0)
    model = _tokentune(MixtralForCausalLM._from_config(config, attn_implementation="sdpa"))
    batch = make_batch("llama")
    with pytest.raises(ValueError, match=r"router_logits in a training forward \(model\.config\.output_router_logits"):
        model(**batch)
    model(**batch, output_router_logits=False).loss.backward()  # trains without the router's loss, as asked
    model.eval()
    with torch.no_grad():
        assert model(**batch).aux_loss.isfinite()  # eval forwards are the plain model's


def test_eval_outputs_are_the_plain_models_and_training_logits_are_the_selected_positions():
    base = build("llama", attn_implementation="eager")
    batch = make_batch("llama", batch=2, length=12)
    reference = copy.deepcopy(base).eval()
    with torch.no_grad():
        expected = reference(**batch, output_hidden_states=True, output_attentions=True)
    torch.manual_seed(1)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])  # B = 0: the plain model's values
    model = get_peft_model(base, TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, lora=lora)).eval()
    with torch.no_grad():
        got = model(**batch, output_hidden_states=True, output_attentions=True)
    for name in ("hidden_states", "attentions"):
        assert len(getattr(got, name)) == len(getattr(expected, name))
        for a, b in zip(getattr(got, name), getattr(expected, name), strict=True):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b)
    # Training, without labels: the README's [batch, n_selected_max, vocab], slot j of row b at mask[b].nonzero()[j]
    model.train()
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    mask = model.base_model.last_token_mask
    assert logits.shape == (2, int(mask.sum(1).max()), expected.logits.shape[-1])
    for row in range(2):
        positions = mask[row].nonzero().squeeze(1)
        torch.testing.assert_close(logits[row, : len(positions)], expected.logits[row, positions])
    assert model(**batch).logits is None  # with labels (chunked loss): documented None


# ------------------------------------------------------------------------------------ non-transformers models
class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class TimmLikeBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.mlp(x)


class TimmLike(nn.Module):
    """A timm-style vision transformer: ``blocks``, ``head``, ``pretrained_cfg``, no transformers ``config``."""

    pretrained_cfg = {"num_classes": 3}

    def __init__(self):
        super().__init__()
        self.blocks = nn.Sequential(TimmLikeBlock(), TimmLikeBlock())
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.blocks(x).mean(1))


MODULES = {"mlp": (MLP, (3, 8), ["fc1", "fc2"]), "timm": (TimmLike, (3, 5, 8), ["mlp.0", "mlp.2", "head"])}


def _module_and_input(kind: str) -> tuple[torch.nn.Module, torch.Tensor]:
    """A module of ``kind`` (one of MODULES) and an input for it, both drawn from seed 0."""
    cls, shape, _ = MODULES[kind]
    torch.manual_seed(0)
    return cls(), torch.randn(*shape)


@pytest.mark.parametrize("kind", sorted(MODULES))
@pytest.mark.parametrize(
    "method",
    [
        lambda targets: TokenTuneConfig(token_ratio=0.5, lora=LoraConfig(r=2, target_modules=targets)),
        lambda targets: TokenTuneConfig(token_ratio=0.5),
        lambda targets: SlimFitConfig(freeze_ratio=0.5, token_selection=TokenSelectionConfig(token_ratio=0.5)),
    ],
    ids=["tokentune+lora", "tokentune", "slimfit+tokentune"],
)
def test_token_selection_on_a_non_transformers_module_is_refused(kind, method):
    cls, _, targets = MODULES[kind]
    with pytest.raises(ValueError, match=f"needs a transformers model .*got {cls.__name__} \\(no `config`"):
        _apply(cls(), method(targets))


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_slimfit_lora_on_a_non_transformers_module_matches_vanilla_lora(kind):
    """Every unit trains at the first step: SlimFit + LoRA's gradients are vanilla PEFT LoRA's."""
    _, _, targets = MODULES[kind]
    base, x = _module_and_input(kind)
    lora = LoraConfig(r=2, target_modules=targets, init_lora_weights=False)
    torch.manual_seed(1)
    vanilla = get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))
    torch.manual_seed(1)
    slim = get_peft_model(base, SlimFitConfig(freeze_ratio=0.0, lora=lora, activation_compression=None))
    for model in (vanilla, slim):
        model.train()
        model(x).pow(2).mean().backward()
    named = dict(slim.named_parameters())
    for name, param in vanilla.named_parameters():
        if param.requires_grad:
            assert torch.equal(param.grad, named[name].grad), name


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_slimfit_full_fine_tuning_of_a_non_transformers_module_trains_the_trained_units_exactly(kind):
    """Base weights trained in place: a trained unit's gradient is autograd's on a plain copy; frozen ones get none."""
    base, x = _module_and_input(kind)
    reference = copy.deepcopy(base)
    reference(x).pow(2).mean().backward()
    slimfit_(base, SlimFitConfig(freeze_ratio=0.5, activation_compression=None))
    base.train()
    base(x).pow(2).mean().backward()
    expected = dict(reference.named_parameters())
    trained = 0
    for name, param in base.named_parameters():
        if param.grad is not None:
            trained += 1  # rounding only: attention takes another kernel path when its weight is frozen
            torch.testing.assert_close(param.grad, expected[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    assert trained > 0
