"""Tiny, randomly initialised models of every architecture TokenTune supports (fast tests only)."""

from __future__ import annotations

import torch
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    BloomConfig,
    BloomForCausalLM,
    DebertaV2Config,
    DebertaV2ForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoConfig,
    GPTNeoForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    RobertaConfig,
    RobertaForSequenceClassification,
    ViTConfig,
    ViTForImageClassification,
)

VOCAB = 97
# The sizes the tiny text models share, and the tiny ViT's.
TEXT_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=VOCAB)
IMAGE_SIZES = dict(
    hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=16, patch_size=4
)
_NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def decoder_config(config_cls=LlamaConfig, **fields):
    """The tiny decoders' config (what ``build("llama")`` and the other decoders use), ``fields`` changed or added."""
    return config_cls(**{**TEXT_SIZES, "num_key_value_heads": 2, "pad_token_id": 0, **fields})


def _decoder(config_cls, model_cls, **extra):
    def build(attn_implementation="sdpa"):
        config = decoder_config(config_cls, **extra)
        return model_cls._from_config(config, attn_implementation=attn_implementation)

    return build


def _bert(attn_implementation="sdpa"):
    config = BertConfig(**TEXT_SIZES, **_NO_DROPOUT, num_labels=3, pad_token_id=0)
    return BertForSequenceClassification._from_config(config, attn_implementation=attn_implementation)


def _roberta(attn_implementation="sdpa"):
    config = RobertaConfig(**TEXT_SIZES, **_NO_DROPOUT, num_labels=3, pad_token_id=1, max_position_embeddings=64)
    return RobertaForSequenceClassification._from_config(config, attn_implementation=attn_implementation)


def _vit(attn_implementation="sdpa"):
    config = ViTConfig(**IMAGE_SIZES, num_labels=3, **_NO_DROPOUT)
    return ViTForImageClassification._from_config(config, attn_implementation=attn_implementation)


def _gpt2(attn_implementation="sdpa"):
    config = GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=VOCAB,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return GPT2LMHeadModel._from_config(config, attn_implementation=attn_implementation)


BUILDERS = {
    "bert": _bert,
    "roberta": _roberta,
    "vit": _vit,
    "gpt2": _gpt2,
    "llama": _decoder(LlamaConfig, LlamaForCausalLM),
    "qwen2": _decoder(Qwen2Config, Qwen2ForCausalLM),
    "qwen3": _decoder(Qwen3Config, Qwen3ForCausalLM, head_dim=8),
    "mistral": _decoder(MistralConfig, MistralForCausalLM),
}
CAUSAL_LM = ("gpt2", "llama", "qwen2", "qwen3", "mistral")
CLASSIFIERS = ("bert", "roberta", "vit")
# Modules LoRA targets on each architecture.
LORA_TARGETS = {
    "bert": ["query", "value"],
    "roberta": ["query", "value"],
    "vit": ["q_proj", "v_proj"],
    "gpt2": ["c_attn", "c_fc"],
    "llama": ["q_proj", "v_proj", "down_proj"],
    "qwen2": ["q_proj", "v_proj", "down_proj"],
    "qwen3": ["q_proj", "v_proj", "down_proj"],
    "mistral": ["q_proj", "v_proj", "down_proj"],
}


def gpt_neo():
    """A tiny GPT-Neo, BLOOM and DeBERTa-v2 (below): architectures TokenTune refuses."""
    config = GPTNeoConfig(
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        attention_types=[[["global"], 2]],
        bos_token_id=1,
        eos_token_id=2,
    )
    return GPTNeoForCausalLM._from_config(config, attn_implementation="eager")


def bloom():
    return BloomForCausalLM._from_config(BloomConfig(hidden_size=32, n_layer=2, n_head=4, vocab_size=VOCAB))


def deberta_v2():
    config = DebertaV2Config(**TEXT_SIZES)
    return DebertaV2ForSequenceClassification._from_config(config, attn_implementation="eager")


def build(arch: str, attn_implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return BUILDERS[arch](attn_implementation)


def make_batch(arch: str, batch: int = 3, length: int = 10, seed: int = 0) -> dict:
    """A padded batch (left padding for decoders, right padding for encoders) with labels."""
    generator = torch.Generator().manual_seed(seed)
    if arch == "vit":
        return {
            "pixel_values": torch.randn(batch, 3, 16, 16, generator=generator),
            "labels": torch.randint(0, 3, (batch,), generator=generator),
        }
    input_ids = torch.randint(3, VOCAB, (batch, length), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    if batch > 1:
        if arch in CAUSAL_LM:
            attention_mask[1, :3] = 0
        else:
            attention_mask[1, -3:] = 0
    pad = 1 if arch == "roberta" else 0
    input_ids = input_ids.masked_fill(attention_mask == 0, pad)
    if arch in CAUSAL_LM:
        labels = input_ids.masked_fill(attention_mask == 0, -100)
    else:
        labels = torch.randint(0, 3, (batch,), generator=generator)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def trainer_kwargs(output_dir, **overrides) -> dict:
    """What the tests' Trainer arguments (TrainingArguments, TRL's configs) start from: the CPU, seed 0, 2
    micro-batches of 2 a step, every step logged, nothing reported or saved, no progress bar or loader workers;
    ``overrides`` change or add fields."""
    args = dict(
        output_dir=str(output_dir),
        report_to=[],
        use_cpu=True,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        logging_steps=1,
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return args | overrides


# One optimizer step whose update is minus the gradient itself: SGD, lr=1, no schedule, warm-up, decay or clipping.
ONE_SGD_STEP = dict(
    max_steps=1,
    optim="sgd",
    learning_rate=1.0,
    lr_scheduler_type="constant",
    warmup_steps=0,
    weight_decay=0.0,
    max_grad_norm=0.0,
)


class FullFineTuned:
    """A plain model with a full fine-tuning transform (``peft_slim.tokentune_`` / ``slimfit_``), handled as the
    tests handle a PeftModel: calls and attributes go to the model, the method's own (``slimfit_step``,
    ``last_token_mask``, ...) to the transform's handle, also reached as ``base_model``."""

    def __init__(self, model, handle):
        self.__dict__.update(model=model, base_model=handle)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__"):  # copy and pickle ask for their hooks before the instance has its attributes
            raise AttributeError(name)
        handle = self.__dict__["base_model"]
        return getattr(handle, name) if hasattr(handle, name) else getattr(self.__dict__["model"], name)

    def get_base_model(self):
        return self.model

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        params = list(self.model.parameters())
        return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)

    @property
    def peft_config(self) -> dict:
        return {"default": self.base_model._config}
