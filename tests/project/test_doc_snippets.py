"""The Python snippets of README.md, docs/loading.md and docs/targets.md run, as written, against small real stores.

Every fenced ```python block of a file runs, in order, in one namespace (like a notebook:
a later block may use what an earlier one defined), in a temporary folder that holds what
the documents name: ``photos/`` (class folders of real JPEG photos), ``val.b2nd``,
``data/train.b2nd`` and ``data/val.b2nd`` (and ``train.b2nd`` for documents that open it
without creating it, see ``DOCUMENTS``). The names a snippet uses without defining them
(``model``, ``make_model``, ``images``, ``labels``, ``keys``, ``more_*``) come from
:func:`prelude`. ``...`` in a snippet is Python's Ellipsis: it runs as a no-op.

A block that cannot run here (it needs the network, a remote store, a GPU) is marked by an
HTML comment on the line right above its opening fence, which the rendered page hides::

    <!-- snippet: skip (needs network) -->

Anything else that breaks a snippet breaks this test: the documented way cannot drift
from the working one.
"""

from __future__ import annotations

import re
import shutil
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest

keras = pytest.importorskip("keras")
pytest.importorskip("tensorflow")

from helpers import tiny_keras_model  # noqa: E402

import carraystore  # noqa: E402
from carraystore.ingest.sample_data import make_photo_folder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: each document, and the stores it reads without creating them beyond the staged ones
#: (README.md creates its train.b2nd with from_directory; docs/loading.md opens one)
DOCUMENTS = {"README.md": (), "docs/loading.md": ("train.b2nd",), "docs/targets.md": ()}
SKIP = re.compile(r"<!--\s*snippet:\s*skip\b")
FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def python_blocks(path: Path) -> list[tuple[int, str, bool]]:
    """(line number, code, skipped) of every ```python block of a Markdown file."""
    text = path.read_text(encoding="utf-8")
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        out.append((line, m.group(1), bool(SKIP.search(before))))
    return out


def test_the_extractor_finds_blocks_and_skip_marks(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "text\n```python\nx = 1\n```\n<!-- snippet: skip (needs network) -->\n```python\nopen_url()\n```\n```sh\nls\n```\n"
    )
    assert python_blocks(doc) == [(2, "x = 1\n", False), (6, "open_url()\n", True)]


def prelude(photo_patches: Callable[..., np.ndarray]) -> dict[str, Any]:
    """What the snippets use without defining it."""
    make_model = partial(tiny_keras_model, 4)
    images = photo_patches(20, size=(64, 64), seed=1)
    more = photo_patches(6, size=(64, 64), seed=2)
    return {
        "__name__": "__snippet__",
        "make_model": make_model,
        "model": make_model(),
        "images": images,
        "labels": np.arange(20) % 2,
        "keys": [f"{'cat' if i % 2 == 0 else 'dog'}/{i}.png" for i in range(20)],
        "more_images": more,
        "more_labels": np.arange(6) % 2,
        "more_keys": [f"{'cat' if i % 2 == 0 else 'dog'}/more{i}.png" for i in range(6)],
    }


@pytest.fixture(scope="module")
def stage(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding what the documents name: photos/, val.b2nd, data/{train,val}.b2nd."""
    root = tmp_path_factory.mktemp("snippets")
    classes = ("astronaut", "chelsea", "coffee", "rocket")
    make_photo_folder(root / "photos", n=128, size=(32, 32), classes=classes, seed=4)
    split = make_photo_folder(
        root / "split", n=128, size=(32, 32), classes=classes, seed=5, splits={"train": 0.75, "val": 0.25}
    )
    carraystore.from_directory(split, root / "data", split_dirs=True, workers=1)
    carraystore.from_directory(split / "val", root / "val.b2nd", workers=1)
    return root


@pytest.mark.parametrize("document", DOCUMENTS)
def test_the_documented_snippets_run(
    document: str,
    stage: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    photo_patches: Callable[..., np.ndarray],
) -> None:
    blocks = python_blocks(ROOT / document)
    assert blocks, f"{document} has no python blocks"
    work = tmp_path / "work"
    shutil.copytree(stage, work)
    for name in DOCUMENTS[document]:
        shutil.copyfile(work / "data" / name, work / name)
    monkeypatch.chdir(work)
    ns = prelude(photo_patches)
    try:
        ran = _run_blocks(document, blocks, ns)
    finally:
        # iterators and datasets the snippets left open (e.g. an unconsumed ``batches``)
        for value in list(ns.values()):
            if type(value).__module__.startswith("carraystore") and callable(getattr(value, "close", None)):
                value.close()
    assert ran, f"every python block of {document} is skipped"


def _run_blocks(document: str, blocks: list[tuple[int, str, bool]], ns: dict[str, Any]) -> int:
    ran = 0
    for line, code, skipped in blocks:
        if skipped:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a snippet's warnings are not failures; its exceptions are
            try:
                exec(compile(code, f"{document}:{line}", "exec"), ns)
            except Exception as exc:
                raise AssertionError(
                    f"the python block at {document}:{line} failed: {type(exc).__name__}: {exc}\n{code}"
                ) from exc
        ran += 1
    return ran
