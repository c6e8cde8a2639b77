"""PNG plots of a benchmark report: memory by category, the accuracy-memory Pareto front, SlimFit's freezing."""

from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import ScalarFormatter  # noqa: E402

from .summary import MEMORY_PARTS  # noqa: E402

COLOURS = {"parameters": "#4c72b0", "gradients": "#dd8452", "optimizer_state": "#55a868", "activations": "#c44e52"}


def memory_breakdown(tasks: list[dict], path: str) -> None:
    """Stacked horizontal bars per method (MiB), one panel per task."""
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 0.35 * _most_methods(tasks) + 1.8))
    for axis, task in zip(np.atleast_1d(axes), tasks):
        names = list(task["methods"])
        left = np.zeros(len(names))
        for part in MEMORY_PARTS:
            values = np.array([task["methods"][n]["memory"][part] / 2**20 for n in names])
            axis.barh(names, values, left=left, color=COLOURS[part], label=part.replace("_", " "))
            left += values
        axis.invert_yaxis()
        axis.set_xlabel("peak training memory (MiB)")
        axis.set_title(task["name"])
    np.atleast_1d(axes)[0].legend(loc="lower right", fontsize="small")
    _save(figure, path)


def pareto_front(points: list[tuple[float, float]], higher_is_better: bool) -> list[tuple[float, float]]:
    """Points no other point beats on both memory (lower) and the metric, sorted by memory."""
    front, best = [], None
    for memory, value in sorted(points, key=lambda p: (p[0], -p[1] if higher_is_better else p[1])):
        if best is None or (value > best if higher_is_better else value < best):
            front.append((memory, value))
            best = value
    return front


def accuracy_vs_memory(tasks: list[dict], path: str, lines: dict[str, list[str]] | None = None) -> None:
    """One panel per task: each method's mean (± sd) against its memory; ``lines``: label -> methods to connect."""
    figure, axes = plt.subplots(1, len(tasks), figsize=(6 * len(tasks), 4.5))
    for axis, task in zip(np.atleast_1d(axes), tasks):
        metric, higher = task["metric"], task["higher_is_better"]
        points = {
            name: (s["total_bytes"] / 2**20, s["metrics"][metric]["mean"], s["metrics"][metric]["std"])
            for name, s in task["methods"].items()
        }
        for name, (memory, value, std) in points.items():
            axis.errorbar(memory, value, yerr=std, fmt="o", capsize=3)
            axis.annotate(name, (memory, value), fontsize=7, xytext=(3, 3), textcoords="offset points")
        for label, names in (lines or {}).items():
            curve = [points[name][:2] for name in names if name in points]
            if len(curve) > 1:
                axis.plot(*zip(*curve), linewidth=1, alpha=0.6, label=label)
        front = pareto_front([(m, v) for m, v, _ in points.values()], higher)
        axis.step(*zip(*front), where="post", color="grey", linestyle="--", label="Pareto front")
        axis.set_xscale("log")
        axis.xaxis.set_major_formatter(ScalarFormatter())
        axis.yaxis.get_major_formatter().set_useOffset(False)
        axis.set_xlabel("peak training memory (MiB, log)")
        axis.set_ylabel(f"{metric} ({'higher' if higher else 'lower'} is better, mean ± sd over seeds)")
        axis.set_title(task["name"])
        axis.legend(fontsize="small")
    _save(figure, path)


def freeze_heatmap(history: dict, title: str, path: str) -> None:
    """Units (rows) by optimizer steps (columns): dark where the unit trained in that step."""
    trained = np.array(history["trained"], dtype=float).T
    figure, axis = plt.subplots(figsize=(min(4 + 0.15 * trained.shape[1], 16), min(2 + 0.12 * trained.shape[0], 20)))
    axis.imshow(trained, aspect="auto", cmap="Greys", interpolation="nearest", vmin=0, vmax=1)
    units = history["units"]
    if len(units) <= 120:
        axis.set_yticks(range(len(units)), units, fontsize=5)
    axis.set_xlabel("optimizer step")
    axis.set_ylabel("unit (weight tensor)")
    axis.set_title(title)
    _save(figure, path)


def _most_methods(tasks: list[dict]) -> int:
    return max(len(task["methods"]) for task in tasks)


def _save(figure, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
