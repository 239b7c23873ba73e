"""Groups (videos, sessions): recorded in the store, natural frame order, group-safe splits,
clips inside a group, and growing a store from folders."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path

import msgpack
import numpy as np
import pytest
from helpers import CLI
from PIL import Image
from spec_reader import read_store

import carraystore
from carraystore.base.errors import ClipError, FormatError, GroupSplitError, InvalidInputError, ShortGroupsWarning
from carraystore.format.record import StoreMeta
from carraystore.ingest.plan import group_split_indices, natural_order


def make_videos(root: Path, spec: dict[str, dict[str, int]], size: tuple[int, int] = (8, 8)) -> Path:
    """``root/<action>/<video>/frame_<t>.png`` for t = 1..n, named as ffmpeg does (no leading zeros).

    Every pixel of frame t of video v holds t, and its green channel the video's number, so
    that order and membership can be read back from the pixels.
    """
    for action, videos in spec.items():
        for video, n in videos.items():
            folder = root / action / video
            folder.mkdir(parents=True, exist_ok=True)
            vid = int(video.rsplit("_", 1)[1])
            for t in range(1, n + 1):
                arr = np.zeros((*size, 3), np.uint8)
                arr[..., 0] = t
                arr[..., 1] = vid
                Image.fromarray(arr).save(folder / f"frame_{t}.png")
    return root


SPEC = {
    "run": {"video_3": 15, "video_10": 9, "video_11": 12},
    "walk": {"video_1": 15, "video_2": 12, "video_4": 11, "video_5": 14},
}


@pytest.fixture()
def videos(tmp_path: Path) -> Path:
    return make_videos(tmp_path / "frames", SPEC)


# -- the format --------------------------------------------------------------------------------


def test_groups_from_the_writer_api_round_trip_and_grow(tmp_path: Path) -> None:
    p = tmp_path / "g.b2nd"
    x = np.zeros((5, 4, 4, 3), np.uint8)
    with carraystore.create(p, (4, 4, 3), class_names=["a", "b"]) as w:
        w.append(x, labels=[0, 0, 1, 1, 1], groups=["cam1", "cam1", "cam2", "cam2", 7])
    s = carraystore.open(p)
    assert s.group_names == ("cam1", "cam2", "7") and s.groups.tolist() == [0, 0, 1, 1, 2]
    with carraystore.append(p) as w:
        w.append(x[:2], labels=[0, 1], groups=["7", "cam9"])
    s = carraystore.open(p)
    assert s.group_names == ("cam1", "cam2", "7", "cam9") and s.groups.tolist() == [0, 0, 1, 1, 2, 2, 3]
    assert s.verify() == []
    # the spec reader reads them from FORMAT.md 4.6 alone
    spec = read_store(p)
    assert spec["group_names"] == list(s.group_names) and spec["groups"].tolist() == s.groups.tolist()
    # a grouped store needs groups on every append; an ungrouped one never takes them
    with pytest.raises(InvalidInputError, match="pass groups= for every append"), carraystore.append(p) as w:
        w.append(x[:1], labels=[0])
    q = tmp_path / "plain.b2nd"
    with carraystore.create(q, (4, 4, 3)) as w:
        w.append(x[:1])
    assert carraystore.open(q).groups is None and carraystore.open(q).group_names is None
    with pytest.raises(InvalidInputError, match="has no groups"), carraystore.append(q) as w:
        w.append(x[:1], groups=["a"])
    with (
        pytest.raises(InvalidInputError, match="one group per item"),
        carraystore.create(tmp_path / "c.b2nd", (4, 4, 3)) as w,
    ):
        w.append(x[:2], groups=["a"])


def test_records_without_groups_do_not_change_and_bad_groups_are_refused(tmp_path: Path) -> None:
    p = tmp_path / "g.b2nd"
    with carraystore.create(p, (4, 4, 3)) as w:
        w.append(np.zeros((3, 4, 4, 3), np.uint8), groups=["a", "a", "b"])
    meta = carraystore.open(p).meta
    rec = meta.to_record()
    plain = StoreMeta.from_record({k: v for k, v in rec.items() if k not in ("groups", "group_names")})
    assert "groups" not in plain.to_record() and "group_names" not in plain.to_record()

    def refused(**change: object) -> str:
        with pytest.raises(FormatError) as info:
            StoreMeta.from_record({**rec, **change})
        return str(info.value)

    assert "go together" in refused(groups=None)
    assert "go together" in refused(group_names=None)
    assert "repeat" in refused(group_names=["a", "a"])
    assert "non-empty" in refused(group_names=["a", ""])
    assert "span" in refused(groups=np.asarray([0, 0, 5], "<i4").tobytes())
    assert "3 items" in refused(groups=np.asarray([0, 1], "<i4").tobytes())
    # msgpack round trip of the real record: what a store holds
    assert StoreMeta.from_record(msgpack.unpackb(msgpack.packb(rec))).group_names == ("a", "b")


# -- ingest: groups from the folder layout, natural order ------------------------------------------


def test_action_video_frame_layout_gives_classes_groups_and_natural_order(videos: Path, tmp_path: Path) -> None:
    r = carraystore.from_directory(videos, tmp_path / "v.b2nd", keep_order=True, workers=2)
    s = carraystore.open(tmp_path / "v.b2nd")
    assert s.class_names == ("run", "walk")  # labels = actions, not videos
    assert s.group_names == (
        "run/video_3",
        "run/video_10",
        "run/video_11",
        "walk/video_1",
        "walk/video_2",
        "walk/video_4",
        "walk/video_5",
    )
    x = s[:]
    # every group's frames are 1, 2, ..., n in order (text order gave 1, 10, 11, ..., 2)
    for g, name in enumerate(s.group_names):
        action, video = name.split("/")
        frames = x[s.groups == g][:, 0, 0, 0]
        assert frames.tolist() == list(range(1, SPEC[action][video] + 1))
        assert set(x[s.groups == g][:, 0, 0, 1].tolist()) == {int(video.split("_")[1])}
        assert set(s.labels[s.groups == g].tolist()) == {s.class_names.index(action)}
    assert list(s.keys)[:3] == ["run/video_3/frame_1.png", "run/video_3/frame_2.png", "run/video_3/frame_3.png"]
    assert r.ngroups == 7
    info = subprocess.run([*CLI, "info", str(tmp_path / "v.b2nd")], capture_output=True, text=True)
    assert "7, 9 to 15 items each: run/video_3, run/video_10" in info.stdout
    assert any("natural order" in n for n in r.notes) and "natural order" in r.summary()


def test_padded_names_keep_text_order_without_a_note(tmp_path: Path) -> None:
    root = tmp_path / "padded" / "walk" / "video_1"
    root.mkdir(parents=True)
    for t in range(1, 13):
        Image.fromarray(np.full((4, 4, 3), t, np.uint8)).save(root / f"frame_{t:05d}.png")
    r = carraystore.from_directory(tmp_path / "padded", tmp_path / "p.b2nd", keep_order=True, workers=1)
    assert r.notes == []
    assert carraystore.open(tmp_path / "p.b2nd")[:][:, 0, 0, 0].tolist() == list(range(1, 13))


def test_natural_order_walks_folders_as_the_listing_does() -> None:
    rels = ["a/x10.png", "a/x2.png", "a/sub/x1.png", "b.png", "b10.png", "b9.png"]
    assert [rels[i] for i in natural_order(rels)] == [
        "b.png",
        "b9.png",
        "b10.png",
        "a/x2.png",
        "a/x10.png",
        "a/sub/x1.png",
    ]
    # class folders keep their (class-name) order
    rels = ["zeta/v_10/f_1.png", "zeta/v_9/f_1.png", "alpha/v_1/f_2.png", "alpha/v_1/f_10.png"]
    assert [rels[i] for i in natural_order(rels, class_first=True)] == [
        "zeta/v_9/f_1.png",
        "zeta/v_10/f_1.png",
        "alpha/v_1/f_2.png",
        "alpha/v_1/f_10.png",
    ]


def test_plain_class_folders_have_no_groups_and_explicit_groups_work(tmp_path: Path) -> None:
    root = tmp_path / "flat"
    for c in ("cat", "dog"):
        (root / c).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(np.full((4, 4, 3), i, np.uint8)).save(root / c / f"{i}.png")
    carraystore.from_directory(root, tmp_path / "f.b2nd", workers=1)
    assert carraystore.open(tmp_path / "f.b2nd").groups is None
    # explicit groups: a function of the relative path, or a mapping
    carraystore.from_directory(
        root, tmp_path / "g.b2nd", workers=1, keep_order=True, groups=lambda rel: f"patient{int(rel[-5]) % 2}"
    )
    s = carraystore.open(tmp_path / "g.b2nd")
    assert s.group_names == ("patient0", "patient1")
    assert [s.group_names[g] for g in s.groups] == [f"patient{int(k[-5]) % 2}" for k in s.keys]
    mapping = {f"{c}/{i}.png": f"s{i}" for c in ("cat", "dog") for i in range(4)}
    del mapping["dog/3.png"]
    with pytest.raises(carraystore.IngestError, match="1 file\\(s\\) have no group, e.g. dog/3.png"):
        carraystore.from_directory(root, tmp_path / "h.b2nd", workers=1, groups=mapping)


# -- validation splits keep groups whole -------------------------------------------------------------


def test_validation_split_never_cuts_a_video(videos: Path, tmp_path: Path) -> None:
    out = tmp_path / "split"
    r = carraystore.from_directory(videos, out, validation_split=0.2, subset="both", keep_order=True, seed=3, workers=2)
    tr, va = carraystore.open(out / "training.b2nd"), carraystore.open(out / "validation.b2nd")
    train_groups = {tr.group_names[g] for g in tr.groups}
    val_groups = {va.group_names[g] for g in va.groups}
    assert train_groups and val_groups and not train_groups & val_groups
    # whole videos: every frame of a validation video is in validation, in order
    for name in val_groups:
        action, video = name.split("/")
        frames = va[:][va.groups == va.group_names.index(name)][:, 0, 0, 0]
        assert frames.tolist() == list(range(1, SPEC[action][video] + 1))
    assert len(tr) + len(va) == sum(sum(v.values()) for v in SPEC.values())
    # both actions in validation (class by class), and the share is reported
    assert set(va.labels.tolist()) == {0, 1}
    note = r["validation"].notes[0]
    assert "in validation" in note and f"{len(va)} of {len(tr) + len(va)} files" in note
    assert any("class coverage: all 2 classes" in n for n in r["validation"].notes)
    assert va.provenance["split_by"] == "groups"
    # seeded: the same seed gives the same videos
    again = carraystore.from_directory(
        videos, tmp_path / "again.b2nd", validation_split=0.2, subset="validation", keep_order=True, seed=3, workers=1
    )
    assert list(carraystore.open(again.path).keys) == list(va.keys)


def test_validation_split_through_the_cli_keeps_videos_whole(videos: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli"
    r = subprocess.run(
        [*CLI, "ingest", str(videos), str(out), "-q", "--keep-order"]
        + ["--validation-split", "0.2", "--subset", "both", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "keeps groups whole" in r.stdout and "natural order" in r.stdout
    tr, va = carraystore.open(out / "training.b2nd"), carraystore.open(out / "validation.b2nd")
    folders = lambda s: {k.rsplit("/", 1)[0] for k in s.keys}  # noqa: E731
    assert not folders(tr) & folders(va)


def test_a_split_that_would_be_empty_is_refused_by_name(tmp_path: Path) -> None:
    root = make_videos(tmp_path / "one", {"walk": {"video_1": 10}})
    with pytest.raises(GroupSplitError, match="1 group"):
        carraystore.from_directory(root, tmp_path / "o", validation_split=0.2, subset="both", workers=1)
    # two groups of one class: the split takes one whole group, whatever share that gives
    tr, va, notes = group_split_indices(["a"] * 8 + ["b"] * 2, np.zeros(10, np.int64), 0.5, seed=0)
    assert sorted(tr.tolist() + va.tolist()) == list(range(10))
    assert {tuple(sorted(set(np.asarray(["a"] * 8 + ["b"] * 2)[va])))} <= {("a",), ("b",)}
    # one group per class: no class gives up its only group, so the smallest group goes (noted)
    tr, va, notes = group_split_indices(["a"] * 3 + ["b"] * 2, np.asarray([0, 0, 0, 1, 1]), 0.9, seed=0)
    assert va.tolist() == [3, 4] and tr.tolist() == [0, 1, 2] and "2 of 5 files (40.0%)" in notes[0]


def test_class_coverage_is_reported(tmp_path: Path) -> None:
    _, va, notes = group_split_indices(["a"] * 4 + ["b"] * 4 + ["c"] * 4, np.asarray([0] * 8 + [1] * 4), 0.5, seed=1)
    assert any("label(s) [1] not in validation" in n for n in notes)


# -- clips ------------------------------------------------------------------------------------------


def test_clips_stay_inside_a_group_and_short_groups_are_named(videos: Path, tmp_path: Path) -> None:
    carraystore.from_directory(videos, tmp_path / "v.b2nd", keep_order=True, workers=1)
    s = carraystore.open(tmp_path / "v.b2nd")
    with pytest.warns(ShortGroupsWarning, match="2 of 7 group\\(s\\).*run/video_10, walk/video_4.*20 samples"):
        batches = list(s.batches(4, sequence_length=12, shuffle=False, clip_starts="fixed"))
    x = np.concatenate([b[0] for b in batches])
    for clip in x:
        assert len(set(clip[:, 0, 0, 1].tolist())) == 1  # one video
        assert np.all(np.diff(clip[:, 0, 0, 0].astype(int)) == 1)  # consecutive frames
    assert len(x) == 5
    with pytest.raises(ClipError, match="no group is long enough for sequence_length=16"):
        s.batches(4, sequence_length=16)
    # groups that all fit: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", ShortGroupsWarning)
        s.batches(4, sequence_length=9)


def test_store_groups_override_key_folders_for_clips(tmp_path: Path) -> None:
    """Groups recorded in the store (not the key's folder) decide where clips may run."""
    p = tmp_path / "s.b2nd"
    with carraystore.create(p, (2, 2, 1)) as w:
        x = np.arange(8, dtype=np.uint8).reshape(8, 1, 1, 1) * np.ones((1, 2, 2, 1), np.uint8)
        w.append(x, keys=[f"all/f{i}.png" for i in range(8)], groups=["s1"] * 4 + ["s2"] * 4)
    s = carraystore.open(p)
    b = next(iter(s.batches(8, sequence_length=4, shuffle=False, clip_starts="fixed")))
    assert b[0][:, :, 0, 0, 0].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]


# -- growing a store from folders ---------------------------------------------------------------------


def test_append_a_new_session_folder(tmp_path: Path) -> None:
    first = make_videos(tmp_path / "day1", {"run": {"video_1": 5}, "walk": {"video_2": 6}})
    out = tmp_path / "s.b2nd"
    carraystore.from_directory(first, out, keep_order=True, image_size=(6, 6), workers=1)
    before = carraystore.open(out)
    old_x, old_keys, old_labels = before[:], list(before.keys), before.labels.copy()
    old_groups = [before.group_names[g] for g in before.groups]
    # a new recording session: one more video of an old class, and a new class
    second = make_videos(tmp_path / "day2", {"walk": {"video_7": 4}, "jump": {"video_8": 3}}, size=(10, 10))
    r = subprocess.run(
        [*CLI, "ingest", str(second), str(out), "--append", "-q"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "appended 7 images" in r.stdout and "new classes added after the store's: jump" in r.stdout
    s = carraystore.open(out)
    assert s.verify() == [] and len(s) == len(old_x) + 7
    assert np.array_equal(s[: len(old_x)], old_x) and list(s.keys)[: len(old_x)] == old_keys
    assert np.array_equal(s.labels[: len(old_x)], old_labels)
    assert s.class_names == ("run", "walk", "jump")  # old classes keep their index
    assert [s.group_names[g] for g in s.groups][: len(old_x)] == old_groups
    new_keys = list(s.keys)[len(old_x) :]
    assert new_keys == [f"jump/video_8/frame_{t}.png" for t in range(1, 4)] + [
        f"walk/video_7/frame_{t}.png" for t in range(1, 5)
    ]  # the store was written in order: the new frames too, in natural order
    new = s[len(old_x) :]
    assert new.shape[1:] == (6, 6, 3)  # resized to the store's size
    assert [s.class_names[v] for v in s.labels[len(old_x) :]] == ["jump"] * 3 + ["walk"] * 4
    assert [s.group_names[g] for g in s.groups[len(old_x) :]] == ["jump/video_8"] * 3 + ["walk/video_7"] * 4
    assert new[:, 0, 0, 0].tolist() == [1, 2, 3, 1, 2, 3, 4]

    # the same folder again: its keys are in the store
    with pytest.raises(carraystore.IngestError, match="7 of the 7 files are already in the store"):
        carraystore.from_directory(second, out, append=True, workers=1)
    # with skip_existing only the new files go in
    make_videos(second, {"walk": {"video_9": 2}})
    res = carraystore.from_directory(second, out, append=True, skip_existing=True, workers=1)
    assert res.nimages == 2 and res.total == len(old_x) + 9
    # the summary's sizes are the whole store's pixels against its whole file, not 2 images against it
    assert res.nbytes == res.total * 6 * 6 * 3 and res.cbytes == out.stat().st_size
    assert "the store: " in res.summary()
    assert list(carraystore.open(out).keys)[-2:] == ["walk/video_9/frame_1.png", "walk/video_9/frame_2.png"]


def test_append_refuses_other_decode_options_by_name(tmp_path: Path) -> None:
    src = make_videos(tmp_path / "a", {"run": {"video_1": 3}})
    out = tmp_path / "s.b2nd"
    carraystore.from_directory(src, out, color_mode="grayscale", workers=1)
    more = make_videos(tmp_path / "b", {"run": {"video_2": 3}})
    with pytest.raises(InvalidInputError, match="color_mode='rgb'.*grayscale"):
        carraystore.from_directory(more, out, append=True, color_mode="rgb")
    with pytest.raises(InvalidInputError, match="dtype='uint16'"):
        carraystore.from_directory(more, out, append=True, dtype="uint16")
    with pytest.raises(InvalidInputError, match="image_size=\\(4, 4\\)"):
        carraystore.from_directory(more, out, append=True, image_size=(4, 4))
    with pytest.raises(InvalidInputError, match="skip_existing applies to append=True"):
        carraystore.from_directory(more, out, skip_existing=True)
    before = out.read_bytes()
    # decode options left out: the store's (grayscale)
    carraystore.from_directory(more, out, append=True, workers=1)
    s = carraystore.open(out)
    assert len(s) == 6 and s.shape[1:] == (8, 8, 1) and s.verify() == []
    assert out.read_bytes() != before


# -- sessions: frames one folder deep, no class folders --------------------------------------


def make_sessions(root: Path, sessions: int = 6, frames: int = 8) -> tuple[Path, list[str]]:
    """``root/session_0k/frame_000123.jpg``: real JPEGs of a dash-cam-like recording per session."""
    rels = []
    rng = np.random.default_rng(11)
    for k in range(sessions):
        folder = root / f"session_{k:02d}"
        folder.mkdir(parents=True)
        for t in range(frames):
            arr = (rng.integers(0, 60, (16, 16, 3)) + k * 30).astype(np.uint8)
            Image.fromarray(arr).save(folder / f"frame_{100 + t:06d}.jpg", quality=90)
            rels.append(f"session_{k:02d}/frame_{100 + t:06d}.jpg")
    return root, sorted(rels)


def test_session_folders_are_groups_and_a_split_keeps_each_session_whole(tmp_path: Path) -> None:
    """`ingest frames/ out/ --labels none --targets m.csv --validation-split 0.2 --subset both` with no
    group column: each session folder is a group, so no session has frames in both parts."""
    from carraystore.cli.main import main

    frames, rels = make_sessions(tmp_path / "frames")
    m = tmp_path / "m.csv"
    m.write_text("file,angle\n" + "".join(f"{r},{i * 0.01!r}\n" for i, r in enumerate(rels)))
    argv = ["ingest", str(frames), str(tmp_path / "out"), "--labels", "none", "--targets", str(m)]
    assert main([*argv, "--validation-split", "0.2", "--subset", "both", "--workers", "1"]) == 0
    seen = []
    for part in ("training", "validation"):
        with carraystore.open(tmp_path / "out" / f"{part}.b2nd") as s:
            assert s.group_names is not None
            assert [s.group_names[g] for g in s.groups] == [k.split("/")[0] for k in s.keys]
            seen.append({k.split("/")[0] for k in s.keys})
    assert seen[0] and seen[1] and not (seen[0] & seen[1])
    assert len(seen[0] | seen[1]) == 6
    res = carraystore.from_directory(frames, tmp_path / "one.b2nd", labels=None, workers=1)
    with carraystore.open(res.path) as s:  # one store: groups recorded too
        assert sorted(s.group_names or ()) == [f"session_{k:02d}" for k in range(6)]


def test_a_split_of_numbered_frames_without_groups_warns_by_name(tmp_path: Path) -> None:
    """Frames of one recording right in the folder (no sub-folders, no groups): a random split puts
    neighbouring frames in both parts, which a FrameSplitWarning and a note say."""
    from carraystore.base.errors import FrameSplitWarning

    frames, _ = make_sessions(tmp_path / "frames", sessions=1, frames=10)
    flat = frames / "session_00"
    with pytest.warns(FrameSplitWarning, match="look like frames of sequences"):
        out = carraystore.from_directory(
            flat, tmp_path / "s", labels=None, validation_split=0.2, subset="both", workers=1
        )
    assert any("neighbouring frames" in n for n in out["training"].notes)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FrameSplitWarning)  # groups given: no warning
        carraystore.from_directory(
            flat, tmp_path / "g", labels=None, groups=lambda r: "a" if r < "frame_000105" else "b",
            validation_split=0.5, subset="both", workers=1,
        )  # fmt: skip
