"""What TokenTune's step peak is made of, at 512 to 2048 tokens, next to the baseline a TRL user has.

One training step (forward, backward, AdamW) of two rows of ``benchmarks.bench_step`` and of TokenTune with 8-bit
compression, on SmolLM2-135M-Instruct (LoRA r=8 on every linear layer), batch 1, one intra-op thread:

* ``tokentune (defaults)``: ``peft-slim train --method tokentune --lora-r 8 --lora-target-modules all-linear``
  (token ratio 0.3, answer tokens selected first);
* ``tokentune (defaults) + 8-bit``: the same with ``--compression-bits 8`` (everything autograd keeps, the unselected
  tokens' keys and values included, stored by ``activation_compression`` in 8 bits);
* ``lora+ckpt+trl-head``: LoRA + checkpointing with TRL's fused LM head (bench_step's baseline).

The rows are synthetic: uniformly random token ids, the last 5% of the row labelled (a long prompt, a short
answer, as bench_budget's ``longqa`` task). Measured per length and method, after one warm-up step:

* step peak: ``peft_slim.memory.peak_memory_bytes`` of one step (above what was held before it);
* forward peak: the same of the forward alone;
* saved for backward: ``peft_slim.memory.SavedActivationBytes`` of the forward (not for the compressed row: its
  compression is a saved-tensor hook itself, which cannot run inside another);
* held after the forward: ``peft_slim.memory.held_memory_bytes`` of the forward (what it leaves allocated: the
  saved tensors, packed or not, and the loss), for every row;
* TokenTune's parts of it, read from the autograd graph after the forward (the saved tensors of each block's
  ``SelectedPass`` node, distinct storages, ``untyped_storage().nbytes()``): the unselected tokens' keys and values
  (the last two tensors each node keeps; the selected tokens' are recomputed in backward) and the selected pass's
  inputs (the selected hidden states, the cut mask and rotary tensors shared by every block);
* other saved: saved for backward minus those two (the head and loss, the scatters' indices);
* the rest of the peak: step peak minus saved for backward (working memory: a block's pass, the head, gradients);
* TokenTune's two working memories measured on their own (peaks above what was held before): one block's pass
  over every token without grad (the base model's last block) and the head + loss on the selected rows, forward
  and backward (``chunked_head_loss``, as TokenTune calls it, on random hidden states);
* the analytic K/V size, ``2 x kv_heads x head_dim x layers x tokens x bytes``, for every token and for the
  unselected ones (a cross-check of the measured keys/values).

``python -m benchmarks.step_parts`` writes ``benchmarks/results/step_parts/step_parts.json`` and ``.md``;
``--quick`` measures a tiny random Llama at a few tokens into ``benchmarks/results/quick/step_parts``. Lengths can be
measured in separate processes (``--lengths 2048 --out <folder>``) and joined with ``--merge <folder>/step_parts.json
...``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_budget, bench_sft, bench_step  # noqa: E402
from benchmarks.report import markdown_table, write_report  # noqa: E402

TOKENTUNE = "tokentune (defaults)"
TOKENTUNE_8BIT = "tokentune (defaults) + 8-bit"
# name -> (`peft-slim train` flags, TRL's fused head, the previous TokenTune step), as bench_step.METHODS
FLAGS = bench_step.METHODS | {
    TOKENTUNE_8BIT: ([*bench_step.METHODS[TOKENTUNE][0], "--compression-bits", "8"], False, False)
}
METHODS = [TOKENTUNE, TOKENTUNE_8BIT, bench_step.BASELINE]
LENGTHS = [512, 1024, 2048]
QUICK_LENGTHS = [32, 64]
ANSWER_SHARE = 0.05  # the labelled tail of each row


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--lengths", nargs="+", type=int, help=f"tokens a row (default {LENGTHS}; quick {QUICK_LENGTHS})"
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS, help="rows to measure (default all)")
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama, a few tokens")
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="join these reports (runs at other lengths), measuring nothing"
    )
    parser.add_argument("--out", help="default benchmarks/results/step_parts (quick: benchmarks/results/quick/...)")
    args = parser.parse_args(argv)
    args.lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    args.out = args.out or os.path.join(bench_sft.RESULTS, *(["quick"] if args.quick else []), "step_parts")
    return args


def tiny_llama():
    """A 2-layer random Llama (grouped-query attention, SDPA) for ``--quick``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config), "tiny random Llama (2 layers, hidden 64)"


def synthetic_batch(length: int, vocab: int) -> dict:
    """One row of random token ids, its last ``ANSWER_SHARE`` labelled."""
    import torch

    generator = torch.Generator().manual_seed(length)
    input_ids = torch.randint(vocab, (1, length), generator=generator)
    labels = input_ids.clone()
    labels[:, : length - max(1, round(length * ANSWER_SHARE))] = -100
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": labels}


def selected_pass_parts(loss) -> dict:
    """Bytes the ``SelectedPass`` nodes of ``loss``'s graph keep (distinct storages): the unselected keys/values (each
    node's last two saved tensors), the selected pass's other inputs, and how many tokens the keys/values cover."""
    from peft_slim.compat import storage_key

    kv, inputs, seen, stack, tokens = {}, {}, set(), [loss.grad_fn], 0
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "SelectedPassBackward":
            saved = node.saved_tensors
            for tensor in saved[-2:]:
                kv[storage_key(tensor)] = tensor.untyped_storage().nbytes()
            for tensor in saved[:-2]:
                inputs[storage_key(tensor)] = tensor.untyped_storage().nbytes()
            tokens = max(tokens, saved[-1].shape[0])  # [unselected tokens of the batch, kv_heads, head_dim]
        stack.extend(next_node for next_node, _ in node.next_functions)
    inputs = {key: n for key, n in inputs.items() if key not in kv}
    return {"kv_bytes": sum(kv.values()), "inputs_bytes": sum(inputs.values()), "unselected_tokens": tokens}


def kv_bytes(config, tokens: int, element_size: int) -> int:
    """``2 x kv_heads x head_dim x layers x tokens x element_size``."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return 2 * kv_heads * head_dim * config.num_hidden_layers * tokens * element_size


def head_loss_peak(base, rows: int) -> int:
    """Peak bytes of TokenTune's head and loss on ``rows`` selected rows, forward and backward: ``chunked_head_loss``
    (what TokenTune calls, with its chunk size) on random hidden states, the base model's head."""
    import torch

    from peft_slim.memory import peak_memory_bytes
    from peft_slim.token_selection.chunked_loss import chunk_rows, chunked_head_loss

    head = base.get_output_embeddings()
    vocab, width = head.weight.shape
    hidden = torch.randn(rows, width, requires_grad=True)
    targets = torch.randint(vocab, (rows,), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        chunked_head_loss(head, [], hidden, targets, chunk_rows(vocab, width, rows)).backward()

    return peak_memory_bytes(step)


def block_pass_peak(base, tokens: int) -> int:
    """Peak bytes of one block (the base model's last) on every token without grad, TokenTune's forward pass of a
    block; causal attention, no mask (the batch has no padding). Llama-style models (``model.rotary_emb``)."""
    import torch

    from peft_slim.memory import peak_memory_bytes
    from peft_slim.token_selection.blocks import find_blocks

    _, blocks = find_blocks(base)
    hidden = torch.randn(1, tokens, base.config.hidden_size)
    positions = torch.arange(tokens)[None]
    with torch.no_grad():
        rotary = base.model.rotary_emb(hidden, positions)

        def step() -> None:
            blocks[-1](hidden, attention_mask=None, position_embeddings=rotary, position_ids=positions)

        return peak_memory_bytes(step)


def measure(name: str, model, context, optimizer, after_step, trl_head: bool, batch: dict) -> dict:
    from peft_slim.memory import SavedActivationBytes, held_memory_bytes, peak_memory_bytes

    batch = batch | ({"fused_lm_head": True} if trl_head else {})
    bench_sft.train_step(model, optimizer, batch, context, after_step)  # warm-up: AdamW's state exists
    saved_bytes, parts = None, {}
    if name != TOKENTUNE_8BIT:
        with context(), SavedActivationBytes(model.parameters()) as saved:
            loss = model(**batch).loss
        saved_bytes = saved.bytes
        parts = selected_pass_parts(loss) if name == TOKENTUNE else {}
        del loss
        optimizer.zero_grad(set_to_none=True)

    def forward():
        with context():
            return model(**batch).loss

    held_bytes, loss = held_memory_bytes(forward)
    del loss
    optimizer.zero_grad(set_to_none=True)

    forward_peak = peak_memory_bytes(forward)
    step = functools.partial(bench_sft.train_step, model, optimizer, batch, context, after_step)
    step_peak = peak_memory_bytes(step)
    return {
        "step_peak_bytes": step_peak,
        "forward_peak_bytes": forward_peak,
        "saved_bytes": saved_bytes,
        "held_after_forward_bytes": held_bytes,
        **parts,
    }


def run(args, base, model_name: str) -> dict:
    config = base.config
    element_size = next(base.parameters()).element_size()
    rows = []
    for name in args.methods:
        flags, trl_head, _ = FLAGS[name]
        parsed = bench_sft.method_args(
            flags, argparse.Namespace(steps=100, learning_rate=1e-3, base_learning_rate=1e-4), 0
        )
        model, context, optimizer, after_step = bench_sft.build_method(base, parsed, 0, trl_head=trl_head)
        for length in args.lengths:
            batch = synthetic_batch(length, config.vocab_size)
            row = {"method": name, "flags": flags, "tokens": length}
            row |= measure(name, model, context, optimizer, after_step, trl_head, batch)
            row["kv_all_tokens_analytic_bytes"] = kv_bytes(config, length, element_size)
            if "unselected_tokens" in row:
                row["kv_unselected_analytic_bytes"] = kv_bytes(config, row["unselected_tokens"], element_size)
                row["head_loss_peak_bytes"] = head_loss_peak(base, length - row["unselected_tokens"])
                row["block_pass_peak_bytes"] = block_pass_peak(base, length)
            rows.append(row)
            print(f"  {name} {length}: peak {row['step_peak_bytes'] / 2**20:.1f} MiB", file=sys.stderr)
        del model, optimizer
    return {
        "model": model_name,
        "data": f"synthetic: 1 row of uniformly random token ids, the last {ANSWER_SHARE:.0%} labelled",
        "lengths": args.lengths,
        "rows": rows,
        "environment": bench_budget.environment(),
    }


def markdown(report: dict) -> str:
    def mib(n_bytes) -> str:
        if n_bytes is None:
            return "-"
        return f"{n_bytes / 2**10:.0f} KiB" if n_bytes < 2**20 else f"{n_bytes / 2**20:.1f} MiB"

    table = []
    for r in report["rows"]:
        tokentune = r["method"] == TOKENTUNE
        other = r["saved_bytes"] - r["kv_bytes"] - r["inputs_bytes"] if tokentune else None
        table.append(
            [
                r["method"],
                r["tokens"],
                mib(r["step_peak_bytes"]),
                mib(r["forward_peak_bytes"]),
                mib(r["saved_bytes"]),
                mib(r.get("held_after_forward_bytes")),
                mib(r.get("kv_bytes")),
                mib(r.get("kv_unselected_analytic_bytes")),
                mib(r["kv_all_tokens_analytic_bytes"]),
                mib(r.get("inputs_bytes")),
                mib(other),
                mib(None if r["saved_bytes"] is None else r["step_peak_bytes"] - r["saved_bytes"]),
                mib(r.get("block_pass_peak_bytes")),
                mib(r.get("head_loss_peak_bytes")),
            ]
        )
    header = [
        "method",
        "tokens",
        "step peak",
        "forward peak",
        "saved for backward",
        "held after the forward",
        "of which K/V kept (unselected)",
        "K/V analytic, unselected",
        "K/V analytic, every token",
        "of which selected pass's inputs",
        "of which other saved",
        "peak minus saved",
        "one block, every token, no grad (peak)",
        "head + loss on the selected rows (peak)",
    ]
    env = report["environment"]
    return "\n".join(
        [
            f"*{report['model']}, batch 1, {report['data']}.*",
            "",
            markdown_table(header, table),
            "",
            f"Measured on: {env['machine']}; torch {env['torch']}, transformers {env['transformers']}, "
            f"peft {env['peft']}; `{report['command']}`.",
        ]
    )


def main(argv=None) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    args = parse_args(argv)
    command = " ".join(["python", "-m", "benchmarks.step_parts", *(sys.argv[1:] if argv is None else argv)])
    report = merged(args.merge, command) if args.merge else measured(args, command)
    os.makedirs(args.out, exist_ok=True)
    write_report(args.out, "step_parts", report, markdown(report))
    return report


def merged(paths: list[str], command: str) -> dict:
    """One report of the rows of ``paths`` (reports of runs at other lengths), rows by method then length."""
    reports = []
    for path in paths:
        with open(path) as handle:
            reports.append(json.load(handle))
    rows = sorted(
        (row for report in reports for row in report["rows"]), key=lambda r: (METHODS.index(r["method"]), r["tokens"])
    )
    lengths = sorted({length for report in reports for length in report["lengths"]})
    commands = [report["command"] for report in reports]
    return reports[0] | {"lengths": lengths, "rows": rows, "command": "; ".join([*commands, command])}


def measured(args, command: str) -> dict:
    """The report of ``args.lengths``, measured in this process."""
    if args.quick:
        base, model_name = tiny_llama()
    else:
        from peft_slim.cli import models

        path, gguf_file, model_name = models.resolve_model(None, None)
        base, _ = models.load_model(path, gguf_file)
    return run(args, base, model_name) | {"command": command}


if __name__ == "__main__":
    main()
