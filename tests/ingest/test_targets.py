"""Targets: per-sample fields (floats, vectors) as y, from ingest, manifests, the writer and dask,
into every loader with the same dtypes and shapes (docs/targets.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import carraystore
from carraystore.base.errors import InvalidInputError, LoaderError, ManifestError
from carraystore.cli.main import main
from carraystore.ingest.sample_data import make_photo_folder

CLASSES = ("astronaut", "chelsea", "coffee", "rocket")


@pytest.fixture(scope="module")
def frames(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 real-photo JPEG frames of 32x32 in one folder (a dashcam recording)."""
    root = tmp_path_factory.mktemp("frames")
    folder = make_photo_folder(root / "photos", n=24, size=(32, 32), classes=("rocket",), seed=7)
    return folder / "rocket"


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """48 real-photo JPEGs of 32x32 in four class folders."""
    return make_photo_folder(tmp_path_factory.mktemp("photos"), n=48, size=(32, 32), classes=CLASSES, seed=8)


def rels_of(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.jpg"))


def angles_for(n: int) -> list[float]:
    return [round(0.37 * np.sin(i / 3) - 0.05, 4) for i in range(n)]


def manifest(path: Path, rels: list[str]) -> dict[str, np.ndarray]:
    """A CSV manifest of an angle (float), a box (vector), a weight and a small int per file."""
    angle = np.array(angles_for(len(rels)))
    box = np.array([[0.1 * (i % 5), 0.2, 0.5, 0.25 + 0.5 * (i % 2)] for i in range(len(rels))])
    weight = np.where(np.arange(len(rels)) % 3 == 0, 2.0, 1.0)
    lane = np.arange(len(rels)) % 3
    with open(path, "w") as f:
        f.write("file,angle,box,weight,lane\n")
        for i, r in enumerate(rels):
            f.write(f'{r},{float(angle[i])!r},"{json.dumps(box[i].tolist())}",{float(weight[i])!r},{int(lane[i])}\n')
    return {"angle": angle, "box": box, "weight": weight, "lane": lane}


@pytest.fixture(scope="module")
def drive(photos: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[carraystore.Store, dict[str, np.ndarray]]:
    """The photos ingested with a manifest: class labels plus fields angle, box, weight, lane."""
    root = tmp_path_factory.mktemp("drive")
    rels = rels_of(photos)
    truth = manifest(root / "frames.csv", rels)
    carraystore.from_directory(photos, root / "drive.b2nd", targets=root / "frames.csv", workers=1, chunk_images=16)
    store = carraystore.open(root / "drive.b2nd")
    by_key = {r: i for i, r in enumerate(rels)}
    order = [by_key[k] for k in store.keys]
    return store, {name: a[order] for name, a in truth.items()}


# -- the bug: float labels -----------------------------------------------------------------------


def test_float_labels_become_the_target_field_not_class_zero(frames: Path, tmp_path: Path) -> None:
    angles = angles_for(24)
    res = carraystore.from_directory(frames, tmp_path / "drive.b2nd", labels=angles, keep_order=True, workers=1)
    store = carraystore.open(res.path)
    assert store.labels is None and store.class_names is None  # no "1 classes: 0 (24)"
    assert store.columns["target"].dtype == np.float64
    assert np.array_equal(store.columns["target"], np.array(angles))  # exactly, in file order
    assert list(store.keys) == rels_of(frames)
    # integers stay class labels
    res = carraystore.from_directory(
        frames, tmp_path / "ints.b2nd", labels=[i % 3 for i in range(24)], keep_order=True, workers=1
    )
    ints = carraystore.open(res.path)
    assert np.array_equal(ints.labels, np.arange(24) % 3) and not ints.columns


def test_float_labels_of_the_wrong_length_are_refused(frames: Path, tmp_path: Path) -> None:
    with pytest.raises(carraystore.IngestError, match="23 labels given for 24 image files"):
        carraystore.from_directory(frames, tmp_path / "x.b2nd", labels=angles_for(23), workers=1)


def test_the_writer_refuses_float_labels_and_says_where_they_go(tmp_path: Path) -> None:
    with carraystore.create(tmp_path / "w.b2nd", (8, 8, 3)) as w:
        with pytest.raises(InvalidInputError, match=r"columns=\{'target'"):
            w.append(np.zeros((2, 8, 8, 3), np.uint8), labels=[0.5, 0.25])
        w.append(np.zeros((2, 8, 8, 3), np.uint8), columns={"angle": np.array([0.5, 0.25])})


# -- float targets into a real model.fit ---------------------------------------------------------


def test_float_targets_reach_model_fit_as_stored(frames: Path, tmp_path: Path) -> None:
    keras = pytest.importorskip("keras")
    from carraystore.keras import StoreDataset

    angles = np.array(angles_for(24))
    carraystore.from_directory(frames, tmp_path / "drive.b2nd", labels=angles.tolist(), keep_order=True, workers=1)
    store = carraystore.open(tmp_path / "drive.b2nd")
    seen: list[np.ndarray] = []

    def mse(y_true, y_pred):  # type: ignore[no-untyped-def]
        seen.append(keras.ops.convert_to_numpy(y_true).reshape(-1).copy())
        return keras.ops.mean(keras.ops.square(keras.ops.reshape(y_true, (-1, 1)) - y_pred))

    inputs = keras.Input((32, 32, 3))
    h = keras.layers.GlobalAveragePooling2D()(keras.layers.Rescaling(1 / 255)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    model.compile("sgd", loss=mse, run_eagerly=True)
    ds = StoreDataset(store, 8, shuffle=False, targets="target")
    hist = model.fit(ds, epochs=1, shuffle=False, verbose=0)
    assert np.isfinite(hist.history["loss"][0])
    got = np.concatenate(seen)
    assert got.shape == (24,)
    assert np.allclose(got, angles.astype(np.float32), rtol=0, atol=1e-7)
    assert len(np.unique(got)) > 10  # not a constant (the bug stored 0 for every frame)


# -- dict / tuple targets, sample weights, the engine's rules -------------------------------------


def test_dict_tuple_targets_and_sample_weight(drive: tuple[carraystore.Store, dict[str, np.ndarray]]) -> None:
    store, truth = drive
    it = store.batches(10, shuffle=False, targets={"cls": "label", "box": "box"}, sample_weight="weight")
    parts = list(it)
    assert all(len(b) == 3 for b in parts)
    y_cls = np.concatenate([b[1]["cls"] for b in parts])
    y_box = np.concatenate([b[1]["box"] for b in parts])
    w = np.concatenate([b[2] for b in parts])
    assert np.array_equal(y_cls, store.labels) and y_cls.dtype == np.int64
    assert np.array_equal(y_box, truth["box"]) and y_box.shape == (48, 4)
    assert w.dtype == np.float32 and np.array_equal(w, truth["weight"].astype(np.float32))
    # a tuple, with label_mode applied to the class label only
    x, y = next(iter(store.batches(12, shuffle=False, targets=("angle", "label"), label_mode="categorical")))
    assert isinstance(y, tuple) and y[0].dtype == np.float64 and np.array_equal(y[0], truth["angle"][:12])
    assert y[1].shape == (12, 4) and y[1].dtype == np.float32
    assert np.array_equal(y[1].argmax(1), store.labels[:12])
    # shuffled batches keep x and y together: the angle follows its image
    images = store[:]
    for x, y in store.batches(16, seed=3, targets="angle"):
        for img, a in zip(x, y, strict=True):
            i = next(j for j in range(len(images)) if np.array_equal(images[j], img))
            assert a == truth["angle"][i]


def test_a_transform_may_return_a_sample_weight(drive: tuple[carraystore.Store, dict[str, np.ndarray]]) -> None:
    # a weight computed on the fly (x, y) -> (x, y, w), through batches(), Keras and both PyTorch datasets
    store, truth = drive

    def weigh(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return x, y, (y + 1).astype(np.float32)

    for b in store.batches(10, shuffle=False, transform=weigh):
        assert len(b) == 3 and np.array_equal(b[2], b[1] + 1)
    with pytest.raises(LoaderError, match="sample_weight= gives one too"):
        list(store.batches(10, shuffle=False, transform=weigh, sample_weight="weight"))
    with pytest.raises(LoaderError, match=r"\(x, y\) or \(x, y, w\), got 4 values"):
        list(store.batches(10, shuffle=False, transform=lambda x, y: (x, y, y, y)))
    torch = pytest.importorskip("torch")
    from carraystore.torch import StoreDataset, StoreMapDataset

    weighed = StoreDataset(store, 10, shuffle=False, transform=weigh)
    mapped = StoreMapDataset(store, 10, shuffle=False, sample_weight="weight")
    for ds, want in ((weighed, store.labels + 1), (mapped, truth["weight"])):
        got = list(ds) if ds is weighed else [ds[i] for i in range(len(ds))]
        assert all(len(b) == 3 and isinstance(b[2], torch.Tensor) for b in got)
        assert np.array_equal(torch.cat([b[2] for b in got]).numpy(), np.asarray(want, np.float32))
    pytest.importorskip("keras")
    from carraystore.keras import StoreDataset as KerasDataset

    kd = KerasDataset(store, 10, shuffle=False, transform=weigh)
    assert np.array_equal(kd[0][2], store.labels[:10] + 1)
    from carraystore.tf import to_dataset

    x, y, w = next(iter(to_dataset(store, 10, shuffle=False, transform=weigh)))
    assert np.array_equal(w.numpy(), store.labels[:10] + 1)


def test_targets_errors_name_the_fields(drive: tuple[carraystore.Store, dict[str, np.ndarray]]) -> None:
    store, _ = drive
    with pytest.raises(InvalidInputError, match=r"no field 'angel'.*did you mean 'angle'"):
        store.batches(8, targets="angel")
    with pytest.raises(InvalidInputError, match="one number per sample"):
        store.batches(8, sample_weight="box")
    with pytest.raises(InvalidInputError, match="targets must be"):
        store.batches(8, targets=("angle", 3))
    with pytest.raises(InvalidInputError, match="label_mode=None"):
        store.batches(8, targets=("angle", "label"), label_mode=None)
    # label_mode=None with the default targets is still x only
    x = next(iter(store.batches(8, label_mode=None)))
    assert x[1] is None


def test_clips_give_the_last_frame_of_a_field_and_the_first_frame_label(tmp_path: Path) -> None:
    images = np.arange(12 * 4 * 4 * 3, dtype=np.uint8).reshape(12, 4, 4, 3)
    with carraystore.create(tmp_path / "c.b2nd", (4, 4, 3), class_names=["a", "b"]) as w:
        w.append(
            images,
            labels=[0] * 6 + [1] * 6,
            keys=[f"v{i // 6}/{i}.png" for i in range(12)],
            columns={"t": np.arange(12.0)},
        )
    store = carraystore.open(tmp_path / "c.b2nd")
    x, y = next(iter(store.batches(4, shuffle=False, sequence_length=3, targets=("label", "t"), clip_starts="fixed")))
    assert x.shape == (4, 3, 4, 4, 3)
    assert y[1].tolist() == [2.0, 5.0, 8.0, 11.0]  # each clip's last frame
    assert y[0].tolist() == [0, 0, 1, 1]


# -- every adapter agrees ---------------------------------------------------------------------------


def test_keras_tf_and_dask_agree_on_dtypes_and_shapes(drive: tuple[carraystore.Store, dict[str, np.ndarray]]) -> None:
    pytest.importorskip("keras")
    tf = pytest.importorskip("tensorflow")
    import carraystore.dask as cd
    from carraystore.keras import StoreDataset
    from carraystore.tf import to_dataset

    store, truth = drive
    args = dict(shuffle=False, targets={"cls": "label", "box": "box", "angle": "angle"}, sample_weight="weight")
    ref_x, ref_y, ref_w = next(iter(store.batches(8, **args)))
    kx, ky, kw = StoreDataset(store, 8, **args)[0]
    ds = to_dataset(store, 8, **args)
    xs, ys, ws = ds.element_spec
    tx, ty, tw = next(iter(ds))
    for name in ("cls", "box", "angle"):
        assert ky[name].dtype == ref_y[name].dtype and ky[name].shape == ref_y[name].shape
        assert ys[name].dtype == tf.as_dtype(ref_y[name].dtype)
        assert ys[name].shape.as_list() == [None, *ref_y[name].shape[1:]]
        assert np.array_equal(ty[name].numpy(), ref_y[name])
    assert ws.dtype == tf.float32 and ws.shape.as_list() == [None] and np.array_equal(tw.numpy(), ref_w)
    assert np.array_equal(kw, ref_w) and np.array_equal(tx.numpy(), ref_x)
    # the dask view: every sample's y as the loaders give it
    y_all, w_all = cd.targets(store, args["targets"], sample_weight="weight")
    for name in ("cls", "box", "angle"):
        assert y_all[name].dtype == ref_y[name].dtype and np.array_equal(y_all[name][:8], ref_y[name])
    assert np.array_equal(w_all, truth["weight"].astype(np.float32))
    f = cd.fields(store)
    assert set(f) == {"angle", "box", "weight", "lane"} and np.array_equal(f["angle"], truth["angle"])
    x = cd.to_dask(store)
    assert np.array_equal(x[f["angle"] > 0].compute(), store[:][truth["angle"] > 0])


def test_from_dask_writes_fields(tmp_path: Path, photo_patches) -> None:  # type: ignore[no-untyped-def]
    da = pytest.importorskip("dask.array")
    import carraystore.dask as cd

    images = photo_patches(40, size=(16, 16), seed=3)
    angle = np.linspace(-1, 1, 40)
    s = cd.from_dask(
        da.from_array(images, chunks=7),
        tmp_path / "d.b2nd",
        chunk_images=8,
        fields={"angle": da.from_array(angle, chunks=9)},
    )
    assert np.array_equal(s.columns["angle"], angle) and np.array_equal(s[:], images)
    assert np.array_equal(cd.targets(s, "angle"), angle)


# -- the manifest ---------------------------------------------------------------------------------


def test_manifest_fields_follow_their_files(drive: tuple[carraystore.Store, dict[str, np.ndarray]]) -> None:
    store, truth = drive
    assert store.provenance["targets"] == "frames.csv"
    assert store.labels is not None and store.class_names == CLASSES
    assert store.columns["angle"].dtype == np.float64 and store.columns["lane"].dtype == np.int64
    for name, a in truth.items():
        assert np.array_equal(store.columns[name], a), name


def test_a_json_lines_manifest_through_the_cli(frames: Path, tmp_path: Path) -> None:
    rels = rels_of(frames)
    m = tmp_path / "frames.jsonl"
    m.write_text(
        "".join(json.dumps({"path": r, "speed": i * 0.5, "kp": [[i, 1], [2, 3]]}) + "\n" for i, r in enumerate(rels))
    )
    assert (
        main(
            [
                "ingest",
                str(frames),
                str(tmp_path / "f.b2nd"),
                "--labels",
                "none",
                "--targets",
                str(m),
                "--keep-order",
                "-q",
            ]
        )
        == 0
    )
    s = carraystore.open(tmp_path / "f.b2nd")
    assert s.columns["kp"].shape == (24, 2, 2) and s.columns["kp"].dtype == np.int64
    assert s.columns["speed"].tolist() == [i * 0.5 for i in range(24)]


def test_a_file_without_a_row_or_a_row_without_a_file_stops_the_ingest(frames: Path, tmp_path: Path) -> None:
    rels = rels_of(frames)
    m = tmp_path / "m.csv"
    manifest(m, rels[:-2])  # two files have no row
    with pytest.raises(ManifestError, match=r"2 of the 24 image files have no row \(.*023\.jpg"):
        carraystore.from_directory(frames, tmp_path / "a.b2nd", labels=None, targets=m, workers=1)
    manifest(m, [*rels_of(frames.parent), "cam/gone.jpg", "elsewhere.jpg"])
    with pytest.raises(
        ManifestError, match=r"2 of its 26 rows name no image file found \(cam/gone.jpg, elsewhere.jpg\)"
    ):
        carraystore.from_directory(frames.parent, tmp_path / "a.b2nd", targets=m, workers=1)
    assert not (tmp_path / "a.b2nd").exists()
    # the CLI says the same, exit 2
    assert main(["ingest", str(frames.parent), str(tmp_path / "a.b2nd"), "--targets", str(m), "-q"]) == 2


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("file,angle\n{0},0.5\n{1},sunny\n", r"line 3, column 'angle': 'sunny' is not a number"),
        ("file,angle\n{0},0.5\n{1},\n", r"line 3, column 'angle': empty value"),
        ('file,box\n{0},"[1, 2]"\n{1},"[1, 2, 3]"\n', r"line 3, column 'box': shape \(3,\) but line 2 has \(2,\)"),
        ("file,angle\n{0},0.5\n{0},0.7\n", r"line 3: 'rocket/.*' has a row already \(line 2\)"),
        ("name,angle\n{0},0.5\n", r"column 'file' or 'path' or 'filename'"),
        ("file,filename,angle\n{0},{0},0.5\n", r"in one column 'file' or 'path' or 'filename'"),
        ("file,label\n{0},1\n", r"column 'label' cannot be a field name"),
    ],
)
def test_bad_manifests_are_named_errors(frames: Path, tmp_path: Path, body: str, message: str) -> None:
    rels = rels_of(frames.parent)
    m = tmp_path / "bad.csv"
    m.write_text(body.format(rels[0], rels[1]))
    with pytest.raises(ManifestError, match=message):
        carraystore.from_directory(frames.parent, tmp_path / "a.b2nd", targets=m, workers=1)


def test_a_manifest_keyed_by_filename_as_keras_flow_from_dataframe(frames: Path, tmp_path: Path) -> None:
    # Keras' flow_from_dataframe names the file column "filename" by default
    rels = rels_of(frames)
    m = tmp_path / "df.csv"
    m.write_text("filename,angle\n" + "".join(f"{r},{i * 0.25}\n" for i, r in enumerate(rels)))
    out = tmp_path / "df.b2nd"
    carraystore.from_directory(frames, out, labels=None, targets=m, workers=1)
    with carraystore.open(out) as s:
        by_key = dict(zip(s.keys, s.columns["angle"], strict=True))
    assert by_key == {r: i * 0.25 for i, r in enumerate(rels)}


def test_create_takes_the_cli_name_of_the_pixel_layout(tmp_path: Path) -> None:
    with carraystore.create(tmp_path / "p.b2nd", (4, 4, 3), "uint8", layout="pixels") as w:
        w.append(np.zeros((2, 4, 4, 3), np.uint8))
    with carraystore.open(tmp_path / "p.b2nd") as s:
        assert s.layout == "NHWC" and len(s) == 2


def test_a_manifest_with_split_dirs_is_keyed_from_the_top(tmp_path: Path) -> None:
    folder = make_photo_folder(
        tmp_path / "p", n=24, size=(16, 16), classes=CLASSES[:2], seed=2, splits={"train": 0.5, "val": 0.5}
    )
    rels = rels_of(folder)
    m = tmp_path / "m.csv"
    m.write_text("file,angle\n" + "".join(f"{r},{i}.5\n" for i, r in enumerate(rels)))
    res = carraystore.from_directory(folder, tmp_path / "out", split_dirs=True, targets=m, workers=1)
    want = {r: i + 0.5 for i, r in enumerate(rels)}
    for split, r in res.items():
        s = carraystore.open(r.path)
        assert s.columns["angle"].tolist() == [want[f"{split}/{k}"] for k in s.keys]


# -- info and preview -------------------------------------------------------------------------------


def test_info_lists_fields_with_a_summary(
    drive: tuple[carraystore.Store, dict[str, np.ndarray]], capsys: pytest.CaptureFixture[str]
) -> None:
    store, truth = drive
    assert main(["info", str(store.path)]) == 0
    out = capsys.readouterr().out
    a = truth["angle"]
    assert f"angle: float64, min {a.min():.6g} mean {a.mean():.6g} max {a.max():.6g}" in out
    assert "box: float64 (4), min 0 " in out
    assert "lane: int64, counts 0 (16), 1 (16), 2 (16)" in out
    assert main(["info", "--json", str(store.path)]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["fields"]["box"]["shape"] == [4] and info["fields"]["lane"]["counts"] == {"0": 16, "1": 16, "2": 16}
    assert info["fields"]["angle"]["max"] == pytest.approx(a.max())


def test_info_summarises_thousands_of_classes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = [f"id{i:04d}" for i in range(2500)]
    with carraystore.create(tmp_path / "many.b2nd", (2, 2, 1), class_names=names) as w:
        w.append(np.zeros((5000, 2, 2, 1), np.uint8), labels=np.arange(5000) % 2500)
    assert main(["info", str(tmp_path / "many.b2nd")]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("labels"))
    assert len(line) < 600 and "id2499" not in line
    assert "2500 classes: id0000 (2), " in line and "... and 2480 more; 2 to 2 items per class" in line
    assert main(["info", "--json", str(tmp_path / "many.b2nd")]) == 0
    assert len(json.loads(capsys.readouterr().out)["label_counts"]) == 2500


def test_preview_captions_with_a_field(drive: tuple[carraystore.Store, dict[str, np.ndarray]], tmp_path: Path) -> None:
    from carraystore.store.export import make_contact_sheet

    store, _ = drive
    plain = np.asarray(make_contact_sheet(store, n=4, cols=4, seed=None, cell=96))
    captioned = np.asarray(make_contact_sheet(store, n=4, cols=4, seed=None, cell=96, caption="angle"))
    assert plain.shape == captioned.shape and not np.array_equal(plain[96:], captioned[96:])  # text under the tiles
    assert np.array_equal(plain[:96], captioned[:96])  # the images themselves are the same
    assert main(["preview", str(store.path), str(tmp_path / "s.png"), "-n", "4", "--caption", "box"]) == 0
    assert (tmp_path / "s.png").stat().st_size > 0
    assert main(["preview", str(store.path), str(tmp_path / "t.png"), "--caption", "nope"]) == 2
    assert not (tmp_path / "t.png").exists()


def test_a_manifest_group_column_gives_the_groups_and_keeps_them_whole_in_splits(frames: Path, tmp_path: Path) -> None:
    """Groups from a manifest column (a recording session per file), text, not a field;
    a validation split then keeps every session whole."""
    rels = rels_of(frames)
    sessions = [f"session_{i // 6}" for i in range(len(rels))]  # 4 sessions of 6 frames
    angles = angles_for(len(rels))
    csv = tmp_path / "frames.csv"
    csv.write_text(
        "file,angle,group\n"
        + "".join(f"{r},{float(a)!r},{g}\n" for r, a, g in zip(rels, angles, sessions, strict=True))
    )
    res = carraystore.from_directory(frames, tmp_path / "s.b2nd", labels=None, targets=csv, keep_order=True, workers=1)
    with carraystore.open(res.path) as s:
        assert set(s.columns) == {"angle"}  # the group column is no field
        got = {k: s.group_names[g] for k, g in zip(s.keys, s.groups, strict=True)}
        assert got == dict(zip(rels, sessions, strict=True))
        assert np.array_equal(s.columns["angle"], np.array(angles))
    out = carraystore.from_directory(
        frames, tmp_path / "split", labels=None, targets=csv, validation_split=0.25, subset="both", workers=1
    )
    parts = {name: carraystore.open(r.path) for name, r in out.items()}
    seen = [{p.group_names[g] for g in p.groups} for p in parts.values()]
    assert seen[0] and seen[1] and not (seen[0] & seen[1])  # no session in both parts
    with pytest.raises(InvalidInputError, match="give one"):
        carraystore.from_directory(frames, tmp_path / "x.b2nd", labels=None, targets=csv, groups=None, workers=1)
    bad = tmp_path / "bad.csv"
    bad.write_text("file,group\n" + "".join(f"{r},\n" for r in rels))
    with pytest.raises(ManifestError, match="must name the file's group"):
        carraystore.from_directory(frames, tmp_path / "y.b2nd", labels=None, targets=bad, workers=1)
