"""TokenTune over every text architecture of the installed transformers: exact against the reference, or refused.

Every model type of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (and every encoder of the sequence-classification mapping)
is built as a tiny random model from its config class's defaults with the sizes shrunk (hidden 64, 2 layers, a small
vocabulary), wrapped in TokenTune + LoRA (``all-linear``), trained for one forward and backward, and compared with the
independent reference gradient of tests/helpers/reference.py (a plain PEFT LoRA model with the same weights, unselected
positions detached at every block input and unselected keys/values detached in attention). Each is classed:

- ``exact``: the gradients and the loss equal the reference's (relative error <= ``TOLERANCE``);
- ``refused``: TokenTune raised a ``ValueError`` of its own (message kept) before any optimizer step;
- ``wrong``: it trained, and the gradients differ from the reference's;
- ``crash``: any other exception (TokenTune's or the model's under TokenTune);
- ``skipped``: not a tiny text model (multimodal, or no tiny config builds, or the plain model's own forward fails).

    python tools/architecture_sweep.py            # sweep, write docs/data/architectures.json and docs/architectures.md
    python tools/architecture_sweep.py --page     # only regenerate docs/architectures.md from the data file
    python tools/architecture_sweep.py --check    # exit 1 if the committed page differs from the data file's rendering
    python tools/architecture_sweep.py --only llama falcon_h1 --print   # a few, printed, nothing written
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import pathlib
import signal
import sys
import time
import traceback
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "architectures.json"
PAGE = ROOT / "docs" / "architectures.md"
TOLERANCE = 1e-4  # relative to the largest reference gradient (fp32); exact architectures are near 1e-6
CLASSES = ("exact", "refused", "wrong", "crash", "skipped")
SIZES = {  # applied to every field the default config has, so each config keeps its own naming
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "dim", "hidden_dim", "embed_dim", "n_embed"), 64),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), 4),
    **dict.fromkeys(("encoder_attention_heads",), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim"), 128),
    **dict.fromkeys(("encoder_ffn_dim", "inner_hidden_size", "d_inner", "hidden_ffn_size", "feed_forward_size"), 128),
    **dict.fromkeys(("head_dim", "attention_head_dim", "d_kv", "kv_channels", "attention_head_size"), 16),
    **dict.fromkeys(("vocab_size",), 128),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx"), 128),
    **dict.fromkeys(
        ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"), 4
    ),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts", "moe_k"), 2),
    **dict.fromkeys(("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"), 32),
    **dict.fromkeys(("kv_lora_rank",), 16),
    **dict.fromkeys(("q_lora_rank",), 32),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim"), 8),
    **dict.fromkeys(("v_head_dim",), 16),
    **dict.fromkeys(("index_n_heads",), 2),
    **dict.fromkeys(("index_head_dim",), 16),
    **dict.fromkeys(("index_topk",), 8),
    **dict.fromkeys(("sliding_window",), 8),
    **dict.fromkeys(("mamba_d_ssm", "mamba_expand_size"), 128),
    **dict.fromkeys(("mamba_n_heads", "mamba_num_heads"), 8),
    **dict.fromkeys(("mamba_d_state", "ssm_state_size", "state_size", "mamba_d_head", "mamba_head_dim"), 16),
    **dict.fromkeys(("mamba_chunk_size", "chunk_size"), 16),
    **dict.fromkeys(("rotary_dim", "rotary_emb_base_dim"), 8),
}
TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")
BATCH, LENGTH, SEED = 2, 24, 0
TIMEOUT_S = 120


class _Timeout(Exception):
    pass


def _alarm(signum, frame):
    raise _Timeout(f"took over {TIMEOUT_S} s")


def tiny_config(model_type: str, num_labels: int | None = None, key_value_heads: int = 2, layers: int = 2):
    """The config class's defaults with ``SIZES`` (only fields it has), dropout 0, token ids inside the vocabulary."""
    from transformers import CONFIG_MAPPING

    config_cls = CONFIG_MAPPING[model_type]
    default = config_cls()
    parts = [name for name in getattr(default, "sub_configs", {}) if getattr(default, name, None) is not None]
    if any(not name.endswith(("attn_config", "ffn_config")) for name in parts):  # DBRX's and MPT's are a block's
        raise _Skip("a composite (multimodal or encoder-decoder) config")
    sizes = {**SIZES, **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads"), key_value_heads)}
    sizes.update(
        {name: layers for name, value in SIZES.items() if value == 2 and "layers" in name or name == "n_layer"}
    )
    fields = {name: value for name, value in sizes.items() if _has_field(default, name)}
    if "qk_rope_head_dim" in fields and "head_dim" in fields:  # latent attention: rotary on qk_rope_head_dim
        fields["head_dim"] = fields["qk_rope_head_dim"]
    if num_labels is not None:
        fields["num_labels"] = num_labels
    for name in ("layer_types", "layers_block_type"):  # every kind of layer the default has, up to `layers` of them
        types = getattr(default, name, None)
        if isinstance(types, (list, tuple)) and types and not isinstance(getattr(type(default), name, None), property):
            distinct = list(dict.fromkeys(types))
            fields[name] = (distinct * layers)[:layers]
    try:
        config = config_cls(**fields)
    except Exception:  # noqa: BLE001 - e.g. `layer_types` derived from another field: keep the default then
        fields.pop("layer_types", None)
        fields.pop("layers_block_type", None)
        config = config_cls(**fields)
    for name, value in config.to_dict().items():
        with contextlib.suppress(AttributeError):
            if ("dropout" in name or name.endswith("_pdrop")) and isinstance(value, float):
                setattr(config, name, 0.0)
            if name in TOKEN_IDS and isinstance(value, int) and value >= SIZES["vocab_size"]:
                setattr(config, name, 1)
    return config


def _has_field(config, name: str) -> bool:
    if isinstance(getattr(type(config), name, None), property):  # derived from other fields
        return False
    try:
        value = getattr(config, name)
    except Exception:  # noqa: BLE001 - absent, or a per-layer attribute a global read refuses
        return False
    if value is None:  # a declared field left to a default derived later (num_key_value_heads, head_dim)
        return name in getattr(config, "__dataclass_fields__", {})
    return isinstance(value, int) and not isinstance(value, bool)


class _Skip(Exception):
    pass


def _build(config, model_cls, implementation: str):
    import torch

    torch.manual_seed(SEED)
    return model_cls._from_config(config, attn_implementation=implementation)


def _batch(kind: str):
    import torch

    generator = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(3, SIZES["vocab_size"], (BATCH, LENGTH), generator=generator)
    labels = input_ids.clone() if kind == "causal_lm" else torch.tensor([0, 2])
    return {"input_ids": input_ids}, labels


def _lora(kind: str, exclude: tuple[str, ...] = ()):
    from peft import LoraConfig

    return LoraConfig(
        r=4,
        target_modules="all-linear",
        exclude_modules=list(exclude) or None,
        init_lora_weights=False,
        task_type=_TASKS[kind],
    )


def _wrap(base, config):
    """``get_peft_model``, leaving out the modules PEFT names as incompatible with LoRA (a Mamba mixer's out_proj)."""
    import re

    from peft import get_peft_model

    exclude: list[str] = []
    while True:
        try:
            return get_peft_model(base, config(tuple(exclude))), tuple(exclude)
        except ValueError as error:
            found = re.search(r"Module '([^']+)' is incompatible", str(error))
            if found is None or found.group(1) in exclude:
                raise
            exclude.append(found.group(1))


_TASKS = {"causal_lm": "CAUSAL_LM", "encoder_classifier": "SEQ_CLS"}


def _is_tokentune_refusal(error: BaseException) -> bool:
    return isinstance(error, ValueError) and str(error).startswith("TokenTune")


def check(model_type: str, kind: str) -> dict:
    """One architecture's class (``CLASSES``), with the refusal's message or the error, and the relative error."""
    import torch
    from peft import get_peft_model
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    from peft_slim import TokenTuneConfig
    from peft_slim.token_selection.blocks import find_blocks

    sys.path.insert(0, str(ROOT / "tests"))
    from helpers.reference import reference_forward, selected_causal_lm_loss

    inputs, labels = _batch(kind)
    implementation, reason = None, ""
    # Grouped keys/values first (some latent-attention models need one per head); 8 layers where a hybrid model's
    # pattern puts no attention layer among the first 2.
    for key_value_heads, layers in ((2, 2), (4, 2), (2, 8), (4, 8)):
        try:
            config = tiny_config(model_type, 3 if kind == "encoder_classifier" else None, key_value_heads, layers)
            mapping = MODEL_FOR_CAUSAL_LM_MAPPING if kind == "causal_lm" else MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING
            model_cls = mapping[type(config)]
        except _Skip as skip:
            return {"class": "skipped", "reason": str(skip)}
        except Exception as error:  # noqa: BLE001 - any failure to build a tiny config is a skip, with its reason
            reason = f"no tiny config builds ({_short(error)})"
            continue
        for candidate in ("sdpa", "eager"):
            try:  # the plain LoRA model must train (a router LoRA wraps may return a tuple, say)
                plain, _ = _wrap(_build(config, model_cls, candidate), lambda exclude: _lora(kind, exclude))
                plain.train()
                plain(**inputs, labels=labels).loss.backward()
                implementation = candidate
                break
            except Exception as error:  # noqa: BLE001
                reason = f"the plain LoRA model's own training step fails ({_short(error)})"
        if implementation is not None:
            break
    if implementation is None:
        return {"class": "skipped", "reason": reason}

    # TokenTune + LoRA.
    base = _build(config, model_cls, implementation)
    try:
        model, exclude = _wrap(
            base,
            lambda exclude: TokenTuneConfig(
                task_type=_TASKS[kind], lora=_lora(kind, exclude), token_ratio=0.4, seed=SEED
            ),
        )
    except Exception as error:  # noqa: BLE001
        if _is_tokentune_refusal(error):
            return {"class": "refused", "reason": str(error), "attn": implementation}
        return {"class": "crash", "reason": _short(error), "attn": implementation}
    try:
        output, mask, loss = _tokentune_step(model, inputs, labels)
    except ValueError as error:
        if "chunked_loss=False" not in str(error):
            return _failure(error, implementation)
        model, exclude = _wrap(  # the model changes its logits: the materialised loss instead of the chunked one
            _build(config, model_cls, implementation),
            lambda exclude: TokenTuneConfig(
                task_type=_TASKS[kind], lora=_lora(kind, exclude), token_ratio=0.4, seed=SEED, chunked_loss=False
            ),
        )
        try:
            output, mask, loss = _tokentune_step(model, inputs, labels)
        except Exception as error:  # noqa: BLE001
            return _failure(error, implementation)
    except Exception as error:  # noqa: BLE001
        return _failure(error, implementation)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}

    # The reference: a plain PEFT LoRA model holding the same weights, under the equivalent definition.
    reference = get_peft_model(_build(config, model_cls, implementation), _lora(kind, exclude))
    reference.load_state_dict(model.state_dict(), strict=False)
    reference.train()
    inner = reference.base_model.model
    with reference_forward(inner, find_blocks(inner)[1], mask, implementation):
        if kind == "causal_lm":
            ref_loss = selected_causal_lm_loss(reference(**inputs).logits, labels, mask)
        else:
            ref_loss = reference(**inputs, labels=labels).loss
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad and p.grad is not None}
    scale = max((g.abs().max().item() for g in ref_grads.values()), default=0.0)
    names = set(grads) | set(ref_grads)
    error = max(
        ((grads.get(n, torch.zeros(())) - ref_grads.get(n, torch.zeros(()))).abs().max().item() for n in names),
        default=0.0,
    )
    relative = error / scale if scale > 0 else float("inf")
    loss_error = abs(loss.item() - ref_loss.item()) / max(1.0, abs(ref_loss.item()))
    result = {"attn": implementation, "relative_error": relative, "loss_error": loss_error}
    result["class"] = "exact" if relative <= TOLERANCE and loss_error <= TOLERANCE else "wrong"
    return result


def _tokentune_step(model, inputs: dict, labels):
    model.train()
    output = model(**inputs, labels=labels)
    mask = model.base_model.last_token_mask.clone()
    output.loss.backward()
    return output, mask, output.loss


def _failure(error: BaseException, implementation: str) -> dict:
    if _is_tokentune_refusal(error):
        return {"class": "refused", "reason": str(error), "attn": implementation}
    return {"class": "crash", "reason": _short(error), "attn": implementation}


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}"


def architectures() -> list[tuple[str, str]]:
    """(model type, kind) of every causal LM, then every encoder sequence classifier that is not also a causal LM."""
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
    )

    causal = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    encoders = sorted(set(MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES) - set(causal))
    return [(t, "causal_lm") for t in causal] + [(t, "encoder_classifier") for t in encoders]


def run(selected: list[tuple[str, str]], verbose: bool = True) -> dict:
    import torch

    torch.set_num_threads(1)
    results = {}
    signal.signal(signal.SIGALRM, _alarm)
    for model_type, kind in selected:
        start = time.perf_counter()
        signal.alarm(TIMEOUT_S)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = check(model_type, kind)
        except _Timeout as error:
            result = {"class": "skipped", "reason": f"the tiny model {error}"}
        except Exception as error:  # noqa: BLE001 - the sweep itself must go on
            result = {"class": "crash", "reason": _short(error), "where": traceback.format_exc(limit=-3)}
        finally:
            signal.alarm(0)
        result["kind"] = kind
        results[model_type if kind == "causal_lm" else f"{model_type} (classifier)"] = result
        if verbose:
            took = time.perf_counter() - start
            print(f"{model_type:28s} {kind:19s} {result['class']:8s} {took:5.1f}s {result.get('reason', '')[:150]}")
            sys.stdout.flush()
    return results


def render(data: dict) -> str:
    results = data["results"]
    counts = {name: sum(r["class"] == name for r in results.values()) for name in CLASSES}
    lines = [
        "# Architectures",
        "",
        "Generated by `tools/architecture_sweep.py` from `docs/data/architectures.json`; do not edit by hand.",
        "",
        f"Every causal-LM architecture of transformers {data['transformers']} (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`) "
        "and every encoder sequence classifier, built as a tiny random model from its config's defaults (hidden size "
        "64, 2 layers, a vocabulary of 128, dropout 0), trained one step with TokenTune + LoRA "
        "(`target_modules='all-linear'`, token ratio 0.4; `chunked_loss=False` where the model changes its logits) "
        "on a batch of 2 rows of 24 tokens without padding and compared with an independent reference gradient "
        "(unselected positions detached at every block input, unselected keys and values detached in attention):",
        "",
        "| class | architectures | meaning |",
        "|---|---|---|",
        f"| exact | {counts['exact']} | gradients and loss equal the reference's (relative error at most "
        f"{data['tolerance']:g}; the largest seen: {data['worst_exact']:.1e}) |",
        f"| refused | {counts['refused']} | a `ValueError` naming the cause at the first training step, before any "
        "optimizer step |",
        f"| wrong | {counts['wrong']} | trained with gradients that differ from the reference's |",
        f"| crash | {counts['crash']} | any other error |",
        f"| skipped | {counts['skipped']} | not a tiny text model: multimodal, no tiny config builds, or the plain "
        "LoRA model's own step fails |",
        "",
        f"Run with torch {data['torch']}. A model of a refused architecture trains with plain LoRA (or SlimFit "
        "without its `token_selection` field).",
        "",
        "No list of architectures decides this: at the first training step of each block (and of each new layout of "
        "its arguments) TokenTune runs the block's selected tokens once more on their own and refuses the model "
        "unless their outputs equal the full pass's within the dtype's rounding, and it checks that the block's "
        "recomputation in backward has the forward's shape and dtype. A block that mixes tokens other than through "
        "its one attention call (a state-space mixer beside attention, a sparse-attention indexer, a mask computed "
        "from the hidden states) is refused there, before any optimizer step; so is one whose model builds blocks "
        "of another layout than `[batch, seq, hidden]`, or whose layers do not pass keyword arguments to attention.",
        "",
        "| architecture | kind | class | attention | refusal, error or reason skipped |",
        "|---|---|---|---|---|",
    ]
    for name in sorted(results):
        result = results[name]
        reason = result.get("reason", "")
        if result["class"] in ("exact", "wrong"):
            reason = f"relative error {result['relative_error']:.1e}"
        reason = reason.replace("|", "\\|").replace("\n", " ")
        kind = "causal LM" if result["kind"] == "causal_lm" else "encoder classifier"
        lines.append(
            f"| {name.removesuffix(' (classifier)')} | {kind} | {result['class']} | {result.get('attn', '')} "
            f"| {reason} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--page", action="store_true", help="only regenerate the page from the data file")
    parser.add_argument("--check", action="store_true", help="exit 1 if the page differs from the data's rendering")
    parser.add_argument("--only", nargs="+", help="model types to sweep (printed, nothing written)")
    parser.add_argument("--shard", help="i/n: sweep every n-th architecture from the i-th (printed, nothing written)")
    args = parser.parse_args()
    if args.check or args.page:
        text = render(json.loads(DATA.read_text()))
        if args.check:
            return int(PAGE.read_text() != text)
        PAGE.write_text(text)
        return 0
    selected = architectures()
    if args.only:
        selected = [(t, k) for t, k in selected if t in args.only]
    if args.shard:
        index, count = map(int, args.shard.split("/"))
        selected = selected[index::count]
    results = run(selected)
    if args.only or args.shard:
        return int(any(r["class"] in ("wrong", "crash") for r in results.values()))
    import torch
    import transformers

    exact = [r["relative_error"] for r in results.values() if r["class"] == "exact"]
    data = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "tolerance": TOLERANCE,
        "worst_exact": max(exact, default=0.0),
        "results": results,
    }
    DATA.parent.mkdir(parents=True, exist_ok=True)
    temporary = DATA.with_suffix(".tmp")
    temporary.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(temporary, DATA)
    PAGE.write_text(render(data))
    counts = {name: sum(r["class"] == name for r in results.values()) for name in CLASSES}
    print(counts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
