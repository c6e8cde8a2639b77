"""How much of the loss TokenTune's answer-first selection keeps at a token ratio, on the equal-budget tasks' data.

    python -m benchmarks.label_coverage [--ratios 0.2 0.3 0.5] [--out benchmarks/results]

At ratio r a row selects at most ceil(r x its real tokens) positions, every labelled position first (a causal LM's
position t when labels[t+1] != -100), so a row whose labelled share is above r leaves some of its loss out of
the step. For each task of ``benchmarks.sft_tasks`` (its training rows, tokenised as the benchmark does) this
draws the package's own selection (``draw_selection``, first and last real token forced, as for a decoder LM) and
counts the labelled positions selected, and the ratio each row would need to select all of them; and under the
library's defaults (``TokenSelectionConfig()``: every labelled position and a share of the prompt, within the
token ratio), the share of the real tokens that train and of the labelled ones kept. No model runs: writes
``label_coverage.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics

import torch
from transformers import AutoTokenizer

from benchmarks import sft_tasks
from benchmarks.harness import RESULTS, environment
from benchmarks.report import markdown_table, write_report
from peft_slim.cli import models
from peft_slim.token_selection.config import TokenSelectionConfig
from peft_slim.token_selection.selection import (
    draw_selection,
    forced_positions,
    labelled_positions,
    ratio_keeping_labels,
)


def coverage(train: list[dict], config: TokenSelectionConfig, seed: int = 0) -> tuple[float, float]:
    """Shares of the labelled positions and of the real tokens of ``train`` that ``config`` selects."""
    generator = torch.Generator().manual_seed(seed)
    selected = labelled_total = trained = tokens = 0
    for example in train:
        labels = torch.tensor([example["labels"]])
        real = torch.ones_like(labels, dtype=torch.bool)
        labelled = labelled_positions(labels, causal=True)
        mask = draw_selection(config, real, forced_positions(real, True, True), labelled, generator)
        selected += int((mask & labelled).sum())
        labelled_total += int(labelled.sum())
        trained, tokens = trained + int(mask.sum()), tokens + labels.shape[1]
    return selected / labelled_total, trained / tokens


def ratio_needed(example: dict) -> float:
    """The lowest ratio at which a row's selection holds every labelled position beside the forced first and last."""
    labels = torch.tensor([example["labels"]])
    return float(ratio_keeping_labels(labels, torch.ones_like(labels, dtype=torch.bool))[0])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ratios", nargs="+", type=float, default=[0.2, 0.3, 0.5])
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args(argv)
    path, gguf_file, model_name = models.resolve_model(None, None)
    tokenizer = AutoTokenizer.from_pretrained(path, gguf_file=gguf_file)
    report = {"model": model_name, "ratios": args.ratios, "environment": environment(), "tasks": {}}
    rows = []
    for task in sft_tasks.TASK_DEFAULTS:
        train, _, description = sft_tasks.task_data(task, tokenizer)
        needed = sorted(ratio_needed(example) for example in train)
        entry = {
            "description": description,
            "rows": len(train),
            "ratio_needed": {"median": statistics.median(needed), "p90": needed[int(0.9 * len(needed))]},
            "labelled_selected": {
                str(ratio): coverage(train, TokenSelectionConfig(token_ratio=ratio, prompt_ratio=1.0))[0]
                for ratio in args.ratios
            },
        }
        kept, trained = coverage(train, TokenSelectionConfig())
        entry["defaults"] = {"labelled_selected": kept, "tokens_trained": trained}
        entry["ratio_needed"]["max"] = needed[-1]
        report["tasks"][task] = entry
        rows.append(
            [task, len(train)]
            + [f"{entry['labelled_selected'][str(ratio)]:.1%}" for ratio in args.ratios]
            + [f"{entry['ratio_needed'][key]:.2f}" for key in ("median", "p90", "max")]
            + [f"{trained:.1%}", f"{kept:.1%}"]
        )
    header = ["task", "train rows"] + [f"labelled kept at {ratio}" for ratio in args.ratios]
    header += ["ratio keeping all: median", "p90", "max"]
    defaults = TokenSelectionConfig()
    rule = f"defaults ({defaults.token_ratio:g}, prompt {defaults.prompt_ratio:g})"
    header += [f"{rule}: tokens trained", "labelled kept"]
    text = "\n\n".join(
        [
            "# Loss kept by answer-first selection",
            markdown_table(header, rows),
            f"{model_name}'s tokenizer; the training rows of `benchmarks.sft_tasks`' tasks as it tokenises them; "
            "one draw per row (seed 0). 'labelled kept at r': at most r of each row, the rest of it filled from "
            "the prompt (prompt ratio 1); 'defaults': `TokenSelectionConfig()`, every labelled position and the "
            "prompt ratio's share of the rest, within the token ratio. Written by "
            "`python -m benchmarks.label_coverage`.",
        ]
    )
    write_report(args.out, "label_coverage", report, text)
    return report


if __name__ == "__main__":
    main()
