"""The policy watch against files that cannot be used: each is refused with its file:line, counted
by reason, the last good policy stays, the watch goes on, and the next valid edit is applied. A
file being written is not read until it is stable. `infermesh policy check` says the same."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from pathlib import Path

import pytest

from infermesh.cli import main as cli_main
from infermesh.meshconfig import policy as policy_mod
from infermesh.meshconfig.policy import LOCAL_POLICY, MAX_POLICY_BYTES, PolicyError, read_policy_bytes
from infermesh.meshconfig.watchers import PolicyFileWatcher

GOOD = LOCAL_POLICY.read_text()
EDITED = GOOD.replace("default_class: batch", "default_class: interactive")
assert EDITED != GOOD


class FakeClock:
    """The watcher's monotonic and wall clocks, moved by the test."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def wall_ns(self) -> int:
        return 0  # every file's mtime is "in the future": only the watcher's own observation settles it


def bomb(levels: int = 9) -> str:
    """Billion laughs: each level is ten aliases of the one before (10^levels scalars expanded)."""
    out = ["a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels + 1):
        out.append(f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]")
    return "\n".join(out) + "\n"


def _write_bytes(data: bytes):
    def write(path: Path) -> None:
        path.write_bytes(data)
    return write


def _make_dir(path: Path) -> None:
    path.unlink()
    path.mkdir()


def _make_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _remove(path: Path) -> None:
    path.unlink()


# (what is written, the reason counted, what the message names)
BAD_FILES = {
    "invalid UTF-8": (_write_bytes(GOOD.encode()[:120] + b"\xff\xfe\xc3(" + GOOD.encode()[120:]), "encoding", "not valid UTF-8"),
    "UTF-16 with a BOM": (_write_bytes(GOOD.encode("utf-16")), "encoding", "byte-order mark"),
    "10k nested [": (_write_bytes(b"classes: " + b"[" * 10_000), "depth", "nested more than 64 levels"),
    "10k nested {": (_write_bytes(b"classes: " + b"{a: " * 10_000), "depth", "nested more than 64 levels"),
    "a YAML bomb": (_write_bytes(bomb().encode()), "size", "expands to more than"),
    "a truncated file": (_write_bytes(GOOD.encode()[: len(GOOD) // 2]), "validation", ":"),
    "a NUL byte": (_write_bytes(GOOD.encode()[:40] + b"\x00" + GOOD.encode()[40:]), "encoding", "#x0000"),
    "YAML syntax": (_write_bytes(GOOD.encode() + b"\n  bad: [unclosed\n"), "yaml", "(yaml)"),
    "a bad timestamp": (_write_bytes(GOOD.replace("version: 1", "version: 2020-13-45").encode()), "yaml", "month must be"),
    # Both escaped load_policy before (found by the fuzz with other seeds): PyYAML's AttributeError, a validator's UnicodeEncodeError.
    "a !!timestamp that does not parse": (_write_bytes(GOOD.replace("version: 1", "version: !!timestamp soon").encode()), "yaml",
                                          "not a valid timestamp"),
    "a lone surrogate escape": (_write_bytes(GOOD.replace("- name: chat\n", '- name: "chat\\ud800"\n').encode()), "yaml", "lone UTF-16 surrogate"),
    "a huge file": (_write_bytes(GOOD.encode() + b"#" * MAX_POLICY_BYTES), "size", "at most"),
    "a directory": (_make_dir, "io", "is a directory"),
    "a FIFO (would block a reader)": (_make_fifo, "io", "not a regular file"),
    "a missing file": (_remove, "io", "No such file"),
}


@pytest.mark.parametrize("kind", list(BAD_FILES))
def test_every_unusable_file_is_refused_counted_and_the_next_valid_edit_applies(tmp_path, kind, caplog):
    write, reason, says = BAD_FILES[kind]
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    clock, seen = FakeClock(), []
    w = PolicyFileWatcher(path, seen.append, clock=clock, wall_ns=clock.wall_ns)
    assert w.load() and len(seen) == 1
    good = w.policy
    t0 = time.monotonic()
    write(path)
    assert not w.poll(), "not stable yet: seen for the first time"
    clock.t += 1
    assert not w.poll()
    assert time.monotonic() - t0 < 5, "refusing it is bounded in time"
    assert w.rejections == 1 and w.policy is good and len(seen) == 1, "the last good policy stays"
    assert w.metrics.value("infermesh_policy_rejections_total", reason=reason) == 1
    msg = str(w.last_error)
    assert msg.startswith(f"{path}:") and says in msg and "\n" not in msg.strip(), msg
    assert any("policy rejected; keeping the last good config" in r.getMessage() for r in caplog.records)
    clock.t += 1
    assert not w.poll() and w.rejections == 1, "a refused file is not read again until it changes"
    if path.is_dir():
        path.rmdir()
    elif path.exists():
        path.unlink()
    path.write_text(EDITED)
    assert not w.poll()
    clock.t += 1
    assert w.poll() and w.policy.default_class == "interactive" and len(seen) == 2
    assert w.metrics.value("infermesh_policy_reloads_total") == 2


def test_a_permission_denied_read_is_refused_and_counted(tmp_path, monkeypatch):
    """Root reads any file; a fake os.open raising EACCES stands for a file the control plane may not read."""
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    w = PolicyFileWatcher(path, lambda p: None, settle=0)
    assert w.load()
    real_open = os.open

    def denied(p, *a, **kw):
        if str(p) == str(path):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *a, **kw)

    monkeypatch.setattr(policy_mod.os, "open", denied)
    path.write_text(EDITED)
    assert not w.poll()
    assert w.metrics.value("infermesh_policy_rejections_total", reason="io") == 1
    assert str(w.last_error) == f"{path}:?: (file): Permission denied"
    monkeypatch.undo()
    os.utime(path)  # a new signature: the file was fixed
    assert w.poll() and w.policy.default_class == "interactive"


def test_the_watch_loop_survives_a_run_of_bad_files_and_a_bug_and_then_applies_a_valid_edit(tmp_path):
    """The failure the issue saw, through the real loop: after an undecodable write the watch task
    died and a valid edit was never applied."""
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    seen = []
    w = PolicyFileWatcher(path, seen.append, settle=0.05)
    assert w.load()
    calls = {"n": 0}
    real_changed = w._changed

    def buggy_once():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("a bug in one poll")
        return real_changed()

    w._changed = buggy_once

    async def main():
        task = asyncio.create_task(w.run(interval=0.01))
        try:
            for kind in ("invalid UTF-8", "10k nested [", "a YAML bomb", "a truncated file"):
                BAD_FILES[kind][0](path)
                deadline = time.monotonic() + 5
                while w.metrics.value("infermesh_policy_rejections_total", reason=BAD_FILES[kind][1]) < 1:
                    assert time.monotonic() < deadline and not task.done(), kind
                    await asyncio.sleep(0.01)
            path.write_text(EDITED)
            deadline = time.monotonic() + 5
            while len(seen) < 2:
                assert time.monotonic() < deadline and not task.done(), "the valid edit was never applied"
                await asyncio.sleep(0.01)
            assert not task.done()
        finally:
            task.cancel()
    asyncio.run(main())
    assert seen[-1].default_class == "interactive"
    assert w.metrics.value("infermesh_policy_rejections_total", reason="internal") == 1, "the bug was counted"


def test_a_callback_that_raises_is_counted_and_the_watch_goes_on(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    fail = {"on": True}

    def on_policy(p):
        if fail["on"]:
            raise ValueError("the control plane's bug")

    w = PolicyFileWatcher(path, on_policy, settle=0)
    assert not w.load()
    assert w.metrics.value("infermesh_policy_rejections_total", reason="internal") == 1
    fail["on"] = False
    path.write_text(EDITED)
    assert w.poll()


# ---- a write in progress ------------------------------------------------------------------------

def test_a_file_written_in_place_is_read_only_once_it_has_settled(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    clock, seen = FakeClock(), []
    w = PolicyFileWatcher(path, seen.append, clock=clock, wall_ns=clock.wall_ns)
    assert w.load()
    with open(path, "r+b") as f:  # an editor overwriting in place: the first half is on disk
        f.truncate(0)
        f.write(EDITED.encode()[: len(EDITED) // 2])
        f.flush()
        assert not w.poll()
        clock.t += w.settle / 2
        assert not w.poll(), "still within the settle interval"
        f.write(EDITED.encode()[len(EDITED) // 2:])  # the rest: the signature moves, the wait starts again
        f.flush()
        clock.t += w.settle / 2 + 0.01
        assert not w.poll(), "the last write was just now"
    clock.t += w.settle
    assert w.poll() and w.rejections == 0 and seen[-1].default_class == "interactive"


def test_an_old_file_settles_by_its_mtime_and_a_renamed_one_at_once(tmp_path):
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    w = PolicyFileWatcher(path, lambda p: None, settle=30)  # only the file's own times can settle it
    assert w.load()
    path.write_text(EDITED)
    assert not w.poll(), "written in place just now"
    old = time.time() - 60
    os.utime(path, (old, old))  # its mtime a minute ago (a touch: its ctime is now)
    assert w.poll()
    tmp = tmp_path / ".policy.yaml.tmp"
    tmp.write_text(GOOD)
    time.sleep(0.02)  # more than a tick of the kernel's file clock between the last write and the rename
    os.replace(tmp, path)
    assert w.poll() and w.policy.default_class == "batch", "an atomic rename is applied at once"


def test_a_writer_appending_rules_in_chunks_is_never_applied_half_written(tmp_path):
    """A real writer thread: every prefix it leaves at a chunk boundary is a valid policy with
    fewer rules, the dangerous kind of half-written file. Only the whole file may be applied."""
    rules = "".join(f"  - name: extra-{i}\n    class: batch\n    match: {{path: {{prefix: /extra/{i}}}}}\n" for i in range(12))
    base = GOOD.split("rules:\n", 1)
    assert len(base) == 2
    full = base[0] + "rules:\n" + rules + base[1]
    assert len(load_policy_text(full).rules) == len(load_policy_text(GOOD).rules) + 12
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    seen = []
    # The writer pauses 30 ms between chunks; a settle interval far above that keeps a stalled
    # thread on a loaded machine from looking like a finished write.
    w = PolicyFileWatcher(path, seen.append, settle=1.0)
    assert w.load()
    data = full.encode()
    cut = [data.index(f"  - name: extra-{i}\n".encode()) for i in range(12)] + [len(data)]

    def writer():
        with open(path, "r+b") as f:
            f.truncate(0)
            done = 0
            for end in cut:
                f.write(data[done:end])
                f.flush()
                done = end
                time.sleep(0.03)

    t = threading.Thread(target=writer)
    t.start()
    deadline = time.monotonic() + 20
    while t.is_alive() or len(seen) < 2:
        w.poll()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    t.join()
    assert [len(p.rules) for p in seen[1:]] == [len(load_policy_text(full).rules)], "only the whole file was applied"
    assert w.rejections == 0


def test_a_file_that_changes_during_the_read_is_read_again(tmp_path, monkeypatch):
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    real_read = os.read
    state = {"writes": 1}

    def read_while_written(fd, n):
        chunk = real_read(fd, n)
        if state["writes"]:
            state["writes"] -= 1
            with open(path, "a") as f:  # a writer appends between our fstat and our last read
                f.write("# more\n")
        return chunk

    monkeypatch.setattr(policy_mod.os, "read", read_while_written)
    with pytest.raises(PolicyError) as e:
        read_policy_bytes(path)
    assert e.value.reason == "changed" and "changed while it was read" in str(e.value)
    w = PolicyFileWatcher(path, lambda p: None, settle=0)
    state["writes"] = 1
    assert w.load(), "load() reads it again once it is still"
    state["writes"] = 1
    path.write_text(EDITED)
    assert not w.poll() and w.rejections == 0, "a changed read is not a rejection"
    assert w.poll() and w.policy.default_class == "interactive"


def load_policy_text(text: str):
    return policy_mod.parse_policy(text)


# ---- `infermesh policy check` ---------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["invalid UTF-8", "UTF-16 with a BOM", "10k nested [", "a YAML bomb", "a directory", "a FIFO (would block a reader)"])
def test_policy_check_says_the_same_with_exit_code_1_and_no_traceback(tmp_path, capsys, kind):
    write, _, says = BAD_FILES[kind]
    path = tmp_path / "policy.yaml"
    path.write_text(GOOD)
    write(path)
    assert cli_main(["policy", "check", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"{path}:") and says in err and "Traceback" not in err, err


def test_the_counters_are_served_as_prometheus_text(tmp_path):
    import urllib.request

    path = tmp_path / "policy.yaml"
    path.write_bytes(b"\xff")
    w = PolicyFileWatcher(path, lambda p: None)
    assert not w.load()
    port = w.metrics.serve("127.0.0.1", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        w.metrics.close()
    assert 'infermesh_policy_rejections_total{reason="encoding"} 1.0' in text
    assert "infermesh_xds_nacks_total" in text and "infermesh_xds_rollbacks_total 0.0" in text
