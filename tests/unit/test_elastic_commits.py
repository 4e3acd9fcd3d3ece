"""Commits on disk (whole or not at all) and the elastic driver's host lists."""

import os

import pytest

from hororing.elastic import commits
from hororing.runner import discovery


def test_a_commit_reads_back_and_only_the_newest_two_are_kept(tmp_path):
    for seq in range(1, 5):
        commits.write(tmp_path, seq, {"step": seq, "weights": list(range(seq))})
    assert commits.sequences(tmp_path) == [4, 3]
    assert commits.newest(tmp_path) == (4, {"step": 4, "weights": [0, 1, 2, 3]})
    assert commits.read(tmp_path, 3) == {"step": 3, "weights": [0, 1, 2]}


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty", "renamed"])
def test_a_damaged_newest_commit_is_skipped_for_the_one_before(tmp_path, damage):
    commits.write(tmp_path, 7, "seven")
    newest = commits.write(tmp_path, 8, "eight" * 1000)
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[:len(data) // 2])
    elif damage == "flip":
        newest.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "empty":
        newest.write_bytes(b"")
    else:  # a file whose name does not match the sequence number inside it
        os.replace(newest, commits.path_of(tmp_path, 9))
    skipped = []
    assert commits.newest(tmp_path, report=lambda *found: skipped.append(found)) == (7, "seven")
    expected = {"truncate": "torn", "flip": "corrupt: its checksum does not match",
                "empty": "torn: 0 bytes", "renamed": "holds commit 8, not 9"}[damage]
    (path, problem), = skipped
    assert path == commits.path_of(tmp_path, 9 if damage == "renamed" else 8)
    assert problem.startswith(expected), problem


def test_a_commit_is_on_the_disk_before_its_name_and_before_the_older_one_goes(tmp_path,
                                                                               monkeypatch):
    events = []
    real_fsync, real_replace, real_unlink = os.fsync, os.replace, type(tmp_path).unlink

    def fsync(descriptor):
        kind = "directory" if os.path.isdir(f"/proc/self/fd/{descriptor}") else "file"
        events.append(f"fsync {kind}")
        real_fsync(descriptor)

    def replace(source, target):
        events.append("rename")
        real_replace(source, target)

    def unlink(path, missing_ok=False):
        events.append(f"unlink {path.name}")
        real_unlink(path, missing_ok=missing_ok)
    commits.write(tmp_path, 1, "one")
    commits.write(tmp_path, 2, "two")
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(type(tmp_path), "unlink", unlink)
    commits.write(tmp_path, 3, "three")
    assert events == ["fsync file", "rename", "fsync directory",
                      f"unlink {commits.path_of(tmp_path, 1).name}"]


def test_half_written_temporaries_are_reported_and_removed(tmp_path):
    commits.write(tmp_path, 1, "one")
    (tmp_path / ".commit-0000000002.pkl.123.tmp").write_bytes(b"x" * 10)
    assert commits.remove_temporaries(tmp_path) == [(".commit-0000000002.pkl.123.tmp", 10)]
    assert commits.remove_temporaries(tmp_path) == []
    assert commits.newest(tmp_path) == (1, "one")
    assert commits.newest(tmp_path / "missing") == (-1, None)


def test_discovery_lines_slots_and_assignment():
    hosts = discovery.parse("# now\nnode1:4\nnode2\n\nnode3:2  # spare\n", 3, "d.sh")
    assert hosts == [("node1", 4), ("node2", 3), ("node3", 2)]
    assert discovery.total_slots(hosts) == 9
    assert discovery.assign(hosts, 6) == [("node1", 4), ("node2", 2)]
    assert discovery.assign(hosts, 9) == hosts
    with pytest.raises(discovery.DiscoveryError, match=r"line 1: expected .* got 'a:0'"):
        discovery.parse("a:0\n", 1, "d.sh")
    with pytest.raises(discovery.DiscoveryError, match="lists 'a' twice"):
        discovery.parse("a:1\na:2\n", 1, "d.sh")


def test_a_failing_or_slow_discovery_script_is_named(tmp_path):
    failing = discovery.ScriptDiscovery("echo no hosts >&2; exit 3")
    with pytest.raises(discovery.DiscoveryError, match="exited with status 3: no hosts"):
        failing()
    slow = discovery.ScriptDiscovery("sleep 5", timeout=0.2)
    with pytest.raises(discovery.DiscoveryError, match="did not finish in 0.2 s"):
        slow()
    assert discovery.ScriptDiscovery("echo h1:2; echo h2")() == [("h1", 2), ("h2", 1)]
