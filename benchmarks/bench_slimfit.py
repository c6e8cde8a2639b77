"""SlimFit against full fine-tuning (MiniLM-L6 shape), and SlimFit + TokenTune + LoRA against LoRA (Llama shape).

All methods run side by side in one process, on the same randomly initialised model and the same batch.
How each number is measured (nothing is estimated from shapes):

* activations: bytes autograd keeps for backward in one training forward: ``SavedActivationBytes``
  (distinct storages, parameters excluded) without compression, the compression's own count of the bytes it
  stored (``last_compression_stats.stored_bytes``) with it;
* parameters, optimizer state: bytes of the model's parameters and of every tensor in the optimizer's state,
  held between steps (after SlimFit's first sweep and 10 more steps: every unit has had optimizer state, and
  ``release_frozen_optimizer_state`` has freed that of units frozen since);
* step peak: the highest running total of the allocator's events during one whole step (forward, backward,
  optimizer step) above what was held before it (``peak_memory_bytes``): activations, gradients and
  temporaries. Total training memory = parameters + optimizer state + step peak; gradients are also reported
  (bytes of every ``.grad`` after the backward);
* step time: median wall time of forward + backward + optimizer step (+ ``slimfit_step``) after warm-up, the
  methods alternating step by step so that machine noise hits all alike.

Usage: ``python benchmarks/bench_slimfit.py`` (MiniLM shape: batch 32 x sequence 128; Llama part: batch 4 x
sequence 1024, ``--llama-layers`` layers) or ``--quick``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import math
import os
import platform
import statistics
import sys
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import BertConfig, BertForSequenceClassification, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peft_slim  # noqa: E402
from benchmarks.bench_tokentune import LORA_TARGETS, smollm2_135m_shape  # noqa: E402
from benchmarks.measure import optimizer_state_bytes, tensor_bytes  # noqa: E402
from benchmarks.report import markdown_table, mib, write_report  # noqa: E402
from benchmarks.side_by_side import add_ratios, time_alternating  # noqa: E402
from peft_slim.memory import SavedActivationBytes, peak_memory_bytes  # noqa: E402
from peft_slim.slimfit import find_slimfit  # noqa: E402
from peft_slim.slimfit.observer import snapshot, step_parts  # noqa: E402
from peft_slim.slimfit.scheduler import score_parts  # noqa: E402

RATIOS = {"activation_bytes": "activation_ratio", "total_bytes": "total_ratio"}


def minilm_l6_shape(layers: int = 6) -> BertConfig:
    """all-MiniLM-L6-v2's architecture (BERT, hidden 384, 12 heads, FFN 1536)."""
    return BertConfig(
        vocab_size=30522,
        hidden_size=384,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=1536,
        max_position_embeddings=512,
        num_labels=3,
        attn_implementation="sdpa",
    )


# The paper's rule: count units, no catch-up, norms and new weights scheduled like every other weight.
PAPER_RULE = {"freeze_by": "count", "catch_up": "none", "always_train_norms": False, "train_new_weights": False}


def bert_methods(layers: int, ratios: list[float], rule: dict | None = None) -> dict[str, torch.nn.Module]:
    """``rule``: SlimFitConfig fields of every SlimFit row (``--rule paper``: the paper's, ``PAPER_RULE``)."""
    rule = rule or {}
    torch.manual_seed(0)
    base = BertForSequenceClassification(minilm_l6_shape(layers))
    methods = {"full": copy.deepcopy(base)}
    for ratio in ratios:
        for compressed in (False, True):
            # AdamW state kept for every unit (SlimFit's default frees it: the ``+release`` row, and bench.md).
            fields = {"release_frozen_optimizer_state": False, **rule}
            if not compressed:
                fields["activation_compression"] = None
            config = peft_slim.SlimFitConfig(freeze_ratio=ratio, seed=0, always_trainable=HEAD, **fields)
            name = f"slimfit{ratio:g}" + ("+compression" if compressed else "")
            methods[name] = _full_fine_tuning(base, config)
    # Optimizer state freed for units frozen 10 steps in a row (the default frees it after 1).
    release = peft_slim.SlimFitConfig(
        freeze_ratio=0.9,
        seed=0,
        release_frozen_optimizer_state=True,
        release_after_steps=10,
        always_trainable=HEAD,
        **rule,
    )
    methods["slimfit0.9+compression+release"] = _full_fine_tuning(base, release)
    return methods


HEAD = ["classifier"]  # trained at every step, as PEFT trains a SEQ_CLS adapter's head


def _full_fine_tuning(base: torch.nn.Module, config) -> torch.nn.Module:
    """A copy of ``base`` with SlimFit's full fine-tuning transform."""
    model = copy.deepcopy(base)
    peft_slim.slimfit_(model, config)
    return model


def llama_methods(layers: int, token_ratio: float, freeze_ratio: float) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    base = LlamaForCausalLM(smollm2_135m_shape(layers))
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    stack = peft_slim.SlimFitConfig(
        task_type="CAUSAL_LM",
        freeze_ratio=freeze_ratio,
        seed=0,
        lora=copy.deepcopy(lora),
        tokentune=peft_slim.TokenTuneConfig(token_ratio=token_ratio, seed=0),
        release_frozen_optimizer_state=False,  # as measured in results/slimfit_stack.md (LoRA state: a few MiB)
    )
    name = f"slimfit{freeze_ratio:g}+tokentune{token_ratio:g}+lora+compression"
    return {"lora": get_peft_model(copy.deepcopy(base), lora), name: get_peft_model(base, stack)}


def training_step(model, optimizer, batch) -> None:
    model(**batch).loss.backward()
    if hasattr(model, "slimfit_attach"):
        model.slimfit_attach(optimizer)  # (again for an attached one: nothing)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    schedule = find_slimfit(model)
    if schedule is not None:
        schedule.slimfit_step(optimizer)


def activation_bytes(model, batch) -> tuple[int, int]:
    tuner = find_slimfit(model)
    with SavedActivationBytes(model.parameters()) as saved:
        loss = model(**batch).loss
    stats = getattr(tuner, "last_compression_stats", None)
    loss.backward()
    gradients = tensor_bytes(p.grad for p in model.parameters() if p.grad is not None)
    model.zero_grad(set_to_none=True)
    return (stats.stored_bytes if stats is not None else saved.bytes), gradients


def measure(methods: dict, batch: dict, warmup_batch: dict, rounds: int) -> dict:
    results = {}
    optimizers = {
        name: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4, weight_decay=0.01)
        for name, m in methods.items()
    }
    for name, model in methods.items():
        model.train()
        # Steady state first (small batches): the first sweep gives every unit optimizer state; 10 more steps let
        # release_frozen_optimizer_state free that of units frozen since.
        scheduler = getattr(find_slimfit(model), "scheduler", None)
        sweep = math.ceil(scheduler.num_units / scheduler.num_trained) + 11 if scheduler is not None else 1
        for _ in range(sweep):
            training_step(model, optimizers[name], warmup_batch)
        activations, gradients = activation_bytes(model, batch)
        training_step(model, optimizers[name], batch)  # warm-up at full size
        held = {
            "parameters": tensor_bytes(model.parameters()),
            "optimizer_state": optimizer_state_bytes(optimizers[name]),
        }
        peak = peak_memory_bytes(lambda m=model, o=optimizers[name]: training_step(m, o, batch))
        results[name] = {
            "activation_bytes": activations,
            "gradient_bytes": gradients,
            **{f"{key}_bytes": value for key, value in held.items()},
            "step_peak_bytes": peak,
            "total_bytes": held["parameters"] + held["optimizer_state"] + peak,
            "step_seconds": [],
        }
    steps = {name: functools.partial(training_step, m, optimizers[name], batch) for name, m in methods.items()}
    for name, seconds in time_alternating(steps, rounds).items():
        results[name]["step_seconds"] = seconds
    return results


def table(results: dict, baseline: str) -> str:
    header = [
        "method",
        "activations",
        f"vs {baseline}",
        "params",
        "optimizer state",
        "gradients",
        "step peak",
        "total",
        f"vs {baseline}",
        "step time",
        f"vs {baseline}",
    ]
    rows = [
        [
            name,
            mib(r["activation_bytes"]),
            f"{r['activation_ratio']:.3f}x",
            mib(r["parameters_bytes"]),
            mib(r["optimizer_state_bytes"]),
            mib(r["gradient_bytes"]),
            mib(r["step_peak_bytes"]),
            mib(r["total_bytes"]),
            f"{r['total_ratio']:.2f}x",
            f"{r['median_step_seconds']:.2f} s",
            f"{r['step_time_ratio']:.2f}x",
        ]
        for name, r in results.items()
    ]
    return markdown_table(header, rows)


def batch_of(vocab: int, batch: int, seq: int, labels: str) -> dict:
    input_ids = torch.randint(0, vocab, (batch, seq))
    target = input_ids if labels == "tokens" else torch.randint(0, 3, (batch,))
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": target}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--bert-batch", type=int, default=32)
    parser.add_argument("--bert-seq", type=int, default=128)
    parser.add_argument("--bert-layers", type=int, default=6)
    parser.add_argument("--llama-batch", type=int, default=4)
    parser.add_argument("--llama-seq", type=int, default=1024)
    parser.add_argument("--llama-layers", type=int, default=8)
    parser.add_argument("--token-ratio", type=float, default=0.2)
    parser.add_argument(
        "--part",
        choices=["bert", "llama", "all", "scoring"],
        default="all",
        help="bert: SlimFit vs full fine-tuning (results in slimfit.*); llama: the stack vs LoRA (slimfit_stack.*); "
        "scoring: the per-step scoring, per tensor against torch._foreach_* (slimfit_scoring.*; not in 'all')",
    )
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 layers, 1 timed step")
    parser.add_argument(
        "--rule",
        choices=["defaults", "paper"],
        default="defaults",
        help="SlimFit rows: the current defaults, or the paper's rule (freeze_by='count', no catch-up) as in 0.1.0",
    )
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.quick:
        args.steps, args.bert_batch, args.bert_seq, args.bert_layers = 1, 4, 64, 2
        args.llama_batch, args.llama_seq, args.llama_layers = 1, 128, 2
    torch.manual_seed(0)
    machine = f"{platform.machine()}, {os.cpu_count()} CPU threads, torch {torch.__version__}"

    suffix = ("_quick" if args.quick else "") + ("_paper" if args.rule == "paper" else "")
    if args.part == "scoring":
        device = "cuda" if torch.cuda.is_available() else "cpu"
        result = scoring(args.bert_layers, 5 if args.quick else 20, device)
        medians = result["median_seconds"]
        text = (
            f"Scoring every weight tensor of a MiniLM-shape BERT ({args.bert_layers} layers, {result['tensors']} "
            f"tensors, {result['values']} values) after one step; {machine}, {device}, {result['clock']}: per tensor "
            f"{medians['per_tensor'] * 1e3:.1f} ms, device-side {medians['foreach'] * 1e3:.1f} ms "
            f"({result['foreach_vs_per_tensor']:.2f}x)."
        )
        write_report(args.out, f"slimfit_scoring{suffix}", {"machine": machine, **result}, text)
        return
    if args.part in ("bert", "all"):
        rule = dict(PAPER_RULE) if args.rule == "paper" else {}
        bert = bert_methods(args.bert_layers, [0.8, 0.9, 0.95], rule)
        vocab = bert["full"].config.vocab_size
        batch, warmup = batch_of(vocab, args.bert_batch, args.bert_seq, "class"), batch_of(vocab, 2, 16, "class")
        results = measure(bert, batch, warmup, args.steps)
        del bert
        add_ratios(results, "full", args.bert_batch * args.bert_seq, RATIOS)
        setup = (
            f"BERT, all-MiniLM-L6-v2 shape, {args.bert_layers} layers, random weights, fp32, sdpa, batch "
            f"{args.bert_batch} x sequence {args.bert_seq}, AdamW (lr 1e-4, weight decay 0.01), SlimFit rule: "
            f"{args.rule}"
        )
        targets = bert_targets(results)
        report = {
            "setup": setup,
            "machine": machine,
            "steps_timed": args.steps,
            "results": results,
            "targets": targets,
        }
        text = [f"Setup: {setup}; {machine}; median of {args.steps} steps.", "", table(results, "full")]
        text += ["", "Targets (issue 4): " + "; ".join(targets)]
        write_report(args.out, f"slimfit{suffix}", report, "\n".join(text))
    if args.part in ("llama", "all"):
        llama = llama_methods(args.llama_layers, args.token_ratio, 0.9)
        vocab = llama["lora"].config.vocab_size
        batch, warmup = batch_of(vocab, args.llama_batch, args.llama_seq, "tokens"), batch_of(vocab, 1, 16, "tokens")
        results = measure(llama, batch, warmup, args.steps)
        add_ratios(results, "lora", args.llama_batch * args.llama_seq, RATIOS)
        setup = (
            f"Llama, SmolLM2-135M shape, {args.llama_layers} layers, random weights, fp32, sdpa, batch "
            f"{args.llama_batch} x sequence {args.llama_seq}, LoRA r=16 on {','.join(LORA_TARGETS)}, AdamW"
        )
        report = {"setup": setup, "machine": machine, "steps_timed": args.steps, "results": results}
        text = [f"Setup: {setup}; {machine}; median of {args.steps} steps.", "", table(results, "lora")]
        write_report(args.out, f"slimfit_stack{suffix}", report, "\n".join(text))


def scoring(layers: int, repeats: int, device: str) -> dict:
    """SlimFit's per-step scoring of every weight tensor of a MiniLM-shape model, two ways in the same run: tensor by
    tensor with a host sync each (``score_parts``, the path before 0.2 and still the FSDP2 one) and without host
    syncs (``step_parts``: sums left on the device, one transfer; ``torch._foreach_*`` on CUDA). CPU time per pass
    (``time.process_time``; on CUDA, wall time after a synchronize)."""
    torch.manual_seed(0)
    model = BertForSequenceClassification(minilm_l6_shape(layers)).to(device)
    params = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    moved = [p.detach() + 1e-4 * torch.randn_like(p) for p in params]
    cuda = device.startswith("cuda")

    def clock():
        if cuda:
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.process_time()

    def per_tensor():
        for old, new in zip([p.detach().clone() for p in params], moved):
            score_parts("relative_change", [old], [new], 1e-3)

    def all_at_once():
        before = snapshot(params)
        step_parts("relative_change", before, moved, 1e-3, [1.0] * len(moved)).tolist()

    seconds = {"per_tensor": [], "foreach": []}
    with torch.no_grad():
        for _ in range(repeats):
            for name, run in (("per_tensor", per_tensor), ("foreach", all_at_once)):
                start = clock()
                run()
                seconds[name].append(clock() - start)
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    return {
        "tensors": len(params),
        "values": sum(p.numel() for p in params),
        "median_seconds": medians,
        "foreach_vs_per_tensor": medians["foreach"] / medians["per_tensor"],
        "clock": "wall (synchronized)" if cuda else "process CPU time",
    }


def bert_targets(results: dict) -> list[str]:
    row = results.get("slimfit0.9+compression")
    if row is None:
        return []
    checks = [
        ("total memory <= 0.45x of full", row["total_ratio"] <= 0.45, f"{row['total_ratio']:.2f}x"),
        ("activations <= 0.3x", row["activation_ratio"] <= 0.3, f"{row['activation_ratio']:.3f}x"),
        ("step time <= 1.1x", row["step_time_ratio"] <= 1.1, f"{row['step_time_ratio']:.2f}x"),
    ]
    return [f"slimfit0.9+compression {label}: {value} {'met' if ok else 'MISSED'}" for label, ok, value in checks]


if __name__ == "__main__":
    main()
