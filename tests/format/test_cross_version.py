"""Stores cross blosc2 versions: the oldest blosc2 that pyproject admits and the newest installed.

A separate virtual environment gets the oldest admitted blosc2 (``pip install
blosc2==FLOOR``) and runs this checkout's code (``PYTHONPATH``, so it is always the
code under test, never a stale installed copy). Stores written by each side are read by
the other bit-exact, and each side appends to the other's stores. The environment is
cached in pytest's cache folder (``.pytest_cache``) between runs. Skips, with the
reason, when pip cannot install the old release (no registry, no wheel for this Python).
``CARRAYSTORE_TEST_OLD_BLOSC2=3.5.1`` tests another old release instead of the floor.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import blosc2
import numpy as np
import pytest

from testsupport import sourcetree

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]

#: Runs under either interpreter: ``write DIR``, ``append DIR`` or ``read DIR``; prints JSON.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import numpy as np
    import blosc2, carraystore

    mode, folder = sys.argv[1], Path(sys.argv[2])
    data = Path(sys.argv[3])
    spec = json.loads((data / "spec.json").read_text())
    out = {"blosc2": blosc2.__version__, "stores": {}}
    for name, s in spec.items():
        items = np.load(data / (name + ".npy"), allow_pickle=False)
        path = folder / (name + ".b2nd")
        labels = np.asarray(s["labels"]) if s["labels"] is not None else None
        keys = s["keys"]
        columns = {c: np.load(data / f, allow_pickle=False) for c, f in s["columns"].items()}
        if mode == "write":
            with carraystore.create(path, items.shape[1:], dtype=items.dtype, codec=s["codec"], chunk_images=s["chunk"],
                                    class_names=s["class_names"], attrs=s["attrs"], layout=s["layout"]) as w:
                if len(items):
                    w.append(items, labels=labels, keys=keys, columns=columns or None)
        elif mode == "append":
            if not len(items):
                continue
            with carraystore.append(path) as w:
                w.append(items[:7], labels=None if labels is None else labels[:7], keys=None if keys is None else keys[:7],
                         columns={c: v[:7] for c, v in columns.items()} or None)
        else:
            store = carraystore.open(path)
            raw = store[:].tobytes()
            want = items.tobytes()
            if s.get("appended") and len(items):
                want += items[:7].tobytes()
            n = len(items) + (7 if s.get("appended") and len(items) else 0)
            res = {
                "pixels": raw == want,
                "plain_blosc2": blosc2.open(str(path), mode="r")[...].tobytes() == want,
                "n": len(store) == n,
                "dtype": store.dtype == items.dtype,
                "verify": [str(p) for p in store.verify()],
                "codec": store.codec.to_config(),
                "writer_blosc2": store.meta.blosc2_version,
                "attrs": store.attrs == s["attrs"],
                "class_names": (list(store.class_names) if store.class_names is not None else None) == s["class_names"],
            }
            if labels is not None:
                lab = labels if not s.get("appended") else np.concatenate([labels, labels[:7]])
                res["labels"] = bool(np.array_equal(store.labels, lab))
            if keys is not None:
                res["keys"] = list(store.keys) == (keys if not s.get("appended") else keys + keys[:7])
            for c, v in columns.items():
                want_c = v.tobytes() + (v[:7].tobytes() if s.get("appended") else b"")
                res["column " + c] = store.columns[c].tobytes() == want_c
            out["stores"][name] = res
    print(json.dumps(out))
    """
)


def _floor() -> str:
    """The lowest blosc2 version pyproject.toml admits (``blosc2>=X``)."""
    text = (ROOT / "pyproject.toml").read_text()
    deps = re.search(r"(?ms)^dependencies\s*=\s*\[(.*?)\]", text)
    assert deps, "pyproject.toml has no [project] dependencies list"
    m = re.search(r"""["']blosc2\s*>=\s*([0-9][0-9.]*)\s*(?:,[^"']*)?["']""", deps.group(1))
    assert m, "pyproject.toml must pin a floor for blosc2 (blosc2>=X)"
    return m.group(1)


def _pip_version() -> tuple[int, ...]:
    """This Python's pip version as numbers, (0,) when it is absent."""
    try:
        version = importlib.metadata.version("pip")
    except importlib.metadata.PackageNotFoundError:
        return (0,)
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def _old_python(request: pytest.FixtureRequest, version: str) -> Path:
    """A venv with blosc2==version, cached in pytest's cache folder (``.pytest_cache``), also
    under ``-p no:cacheprovider``: it holds only the pinned third-party packages (this
    checkout's code comes from ``PYTHONPATH``), and a stamp of the pins says when it is ready.
    It is built under a name of its own and renamed into place, so that two sessions that
    build it at once never install into the same folder."""
    cache = getattr(request.config, "cache", None)
    name = f"carraystore-blosc2-{version}"
    base = Path(cache.mkdir(name)) if cache is not None else request.config.rootpath / ".pytest_cache" / "d" / name
    base.mkdir(parents=True, exist_ok=True)
    venv = base / "venv"
    bin_python = "Scripts/python.exe" if os.name == "nt" else "bin/python"
    pins = [f"blosc2=={version}", "numpy<2.3", "msgpack", "pillow", "tqdm"]

    def ready(folder: Path) -> bool:
        stamp = folder / "carraystore-ready.json"
        return stamp.exists() and json.loads(stamp.read_text()) == pins and (folder / bin_python).exists()

    if ready(venv):
        return venv / bin_python
    shutil.rmtree(venv, ignore_errors=True)
    building = Path(tempfile.mkdtemp(prefix="venv-building-", dir=base))
    shutil.rmtree(building)
    python = building / bin_python
    # Without a pip of its own (ensurepip takes most of the time): this Python's pip installs
    # into it (``pip --python``, pip >= 22.3); an older pip gets the venv its own pip.
    outer = _pip_version() >= (22, 3)
    subprocess.run(
        [sys.executable, "-m", "venv", *(["--without-pip"] if outer else []), str(building)],
        check=True,
        capture_output=True,
    )
    r = subprocess.run(
        [
            *([sys.executable, "-m", "pip", "--python", str(python)] if outer else [str(python), "-m", "pip"]),
            "install",
            "--disable-pip-version-check",
            "--quiet",
            "--only-binary",
            "blosc2",
            *pins,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if r.returncode != 0:
        tail = " | ".join((r.stdout + r.stderr).strip().splitlines()[-3:])
        shutil.rmtree(building, ignore_errors=True)
        pytest.skip(
            f"cannot install blosc2=={version} in a fresh venv (no registry, or no wheel for Python "
            f"{sys.version_info.major}.{sys.version_info.minor}): {tail}"
        )
    (building / "carraystore-ready.json").write_text(json.dumps(pins))
    try:
        building.rename(venv)
    except OSError:  # another session put its own in place meanwhile
        shutil.rmtree(building, ignore_errors=True)
        if not ready(venv):
            raise
    return venv / bin_python


def _run(python: Path | str, mode: str, folder: Path, data: Path, script: Path) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": sourcetree.pythonpath(folder), "PYTHONDONTWRITEBYTECODE": "1"}
    r = subprocess.run(
        [str(python), str(script), mode, str(folder), str(data)], capture_output=True, text=True, env=env, timeout=300
    )
    assert r.returncode == 0, f"{mode} with {python} failed:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _make_data(folder: Path, patches: Callable[..., np.ndarray]) -> None:
    """Real-photo inputs and what to write: every layout, dtype, preset and metadata kind."""
    spec: dict[str, Any] = {}

    def add(
        name: str,
        items: np.ndarray,
        codec: str | None = None,
        chunk: int = 8,
        labels: bool = False,
        keys: bool = False,
        columns: dict[str, np.ndarray] | None = None,
        layout: str | None = None,
        class_names: list[str] | None = None,
    ) -> None:
        np.save(folder / f"{name}.npy", items, allow_pickle=False)
        n = len(items)
        cols = {}
        for c, v in (columns or {}).items():
            np.save(folder / f"{name}.col-{c}.npy", v, allow_pickle=False)
            cols[c] = f"{name}.col-{c}.npy"
        spec[name] = {
            "codec": codec,
            "chunk": chunk,
            "layout": layout,
            "columns": cols,
            "labels": (np.arange(n) % 3).tolist() if labels else None,
            "keys": [f"cls{i % 3}/img_{i:04d}.jpg" for i in range(n)] if keys else None,
            "class_names": class_names if class_names is not None else (["a", "b", "c"] if labels else None),
            "attrs": {"name": name, "nested": {"x": [1, 2.5, None, "ü"]}},
        }

    rgb = patches(21, (16, 16), 1)
    luma = (rgb.astype(np.uint32) @ np.array([19595, 38470, 7471], np.uint32) + 0x8000) >> 16
    add("rgb_default", rgb, labels=True, keys=True)
    add("rgb_small", patches(19, (16, 16), 2), codec="small", keys=True)
    add("rgba_fast", np.concatenate([rgb, luma[..., None].astype(np.uint8)], axis=-1), codec="fast", labels=True)
    add("gray_uint16", ((luma.astype(np.uint16) << 8) | luma[::-1].astype(np.uint16))[..., None], chunk=4)
    add("gray_small", luma[..., None].astype(np.uint8), codec="small", chunk=4)
    add("float32_rgb", rgb.astype(np.float32) / np.float32(255), chunk=4)
    add("black", np.concatenate([np.zeros((8, 16, 16, 3), np.uint8), rgb[:5]]), chunk=8)
    add("empty", np.zeros((0, 16, 16, 3), np.uint8), class_names=["x"])
    add("ints_1d", rgb.reshape(21, -1).astype(np.int64).sum(axis=1), chunk=4)
    rec_dt = np.dtype(
        {
            "names": ["label", "key", "mean", "big"],
            "formats": ["<i2", "S10", ("<f4", (3,)), ">u4"],
            "offsets": [0, 4, 16, 32],
            "itemsize": 40,
        }
    )
    rec = np.zeros(21, rec_dt)
    rec["label"] = np.arange(21) - 10
    rec["key"] = [f"r/{i}.png".encode() for i in range(21)]
    rec["mean"] = rgb.reshape(21, -1, 3).mean(axis=1)
    rec["big"] = rgb.reshape(21, -1).astype(np.uint32).sum(axis=1)
    add("records", rec, chunk=4, columns={"frame": np.arange(21, dtype=np.int32)})
    (folder / "spec.json").write_text(json.dumps(spec))


def _check(result: dict[str, Any], writers: dict[str, str], spec: dict[str, Any]) -> dict[str, Any]:
    """Assert every store read back exactly and names its last writer's blosc2; return the codecs."""
    assert set(result["stores"]) == set(spec)
    for name, res in result["stores"].items():
        bad = {k: v for k, v in res.items() if k not in ("verify", "codec", "writer_blosc2") and v is not True}
        assert not bad and res["verify"] == [], f"{name} (reader blosc2 {result['blosc2']}): {bad} {res['verify']}"
        assert res["writer_blosc2"] == writers[name], name
    return {name: res["codec"] for name, res in result["stores"].items()}


def test_oldest_admitted_blosc2_and_newest_read_each_other(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    photo_patches: Callable[..., np.ndarray],
) -> None:
    floor = os.environ.get("CARRAYSTORE_TEST_OLD_BLOSC2") or _floor()  # the override is for trying other releases
    old = _old_python(request, floor)
    script = tmp_path / "cross.py"
    script.write_text(SCRIPT)
    data = tmp_path / "data"
    data.mkdir()
    _make_data(data, photo_patches)
    spec = json.loads((data / "spec.json").read_text())
    new = sys.executable
    assert blosc2.__version__ != floor, "the test environment should have a newer blosc2 than the floor"

    by_new, by_old = tmp_path / "by_new", tmp_path / "by_old"
    by_new.mkdir()
    by_old.mkdir()
    assert _run(new, "write", by_new, data, script)["blosc2"] == blosc2.__version__
    assert _run(old, "write", by_old, data, script)["blosc2"] == floor

    # newest writes, oldest reads; oldest writes, newest reads
    everyone = dict.fromkeys(spec)
    codecs_new = _check(_run(old, "read", by_new, data, script), dict.fromkeys(spec, blosc2.__version__), spec)
    codecs_old = _check(_run(new, "read", by_old, data, script), dict.fromkeys(spec, floor), spec)
    assert codecs_new == codecs_old  # both versions resolve and record the same codecs

    # each appends to the other's stores with the pinned codec; both read the results
    for s in spec.values():
        s["appended"] = True
    (data / "spec.json").write_text(json.dumps(spec))
    _run(old, "append", by_new, data, script)
    _run(new, "append", by_old, data, script)
    empty = {n for n in everyone if not len(np.load(data / f"{n}.npy"))}
    for reader in (old, new):
        after_new = _check(
            _run(reader, "read", by_new, data, script),
            {n: blosc2.__version__ if n in empty else floor for n in spec},
            spec,
        )
        after_old = _check(
            _run(reader, "read", by_old, data, script),
            {n: floor if n in empty else blosc2.__version__ for n in spec},
            spec,
        )
        assert after_new == codecs_new and after_old == codecs_old
