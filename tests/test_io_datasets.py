"""Loaders on malformed input, and the atomic-write helpers under a simulated crash."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mempo.datasets import iter_corpus, load_qa
from mempo.errors import DataError
from mempo.io import ReadStats, atomic_dir, atomic_path, iter_jsonl, write_jsonl

GOOD_QA = {"id": "a", "question": "Who?", "golden_answers": ["x"]}
GOOD_DOC = {"id": "1", "contents": "Title\ntext"}


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(lines))
    return path


def _j(obj: object) -> bytes:
    return (json.dumps(obj) + "\n").encode()


BAD_QA = {
    "missing_question": ([_j(GOOD_QA), _j({"id": "b", "golden_answers": ["y"]})], 2, "question"),
    "empty_answers": ([_j(GOOD_QA), _j({"id": "b", "question": "Q?", "golden_answers": []})], 2, "golden_answers"),
    "empty_answer_item": ([_j({"id": "b", "question": "Q?", "golden_answers": ["ok", " "]})], 1, "golden_answers"),
    "not_utf8": ([_j(GOOD_QA), b'{"id": "b", "question": "\xff\xfe", "golden_answers": ["y"]}\n'], 2, None),
    "truncated_last_line": ([_j(GOOD_QA), b'{"id": "b", "question": "Q?", "golden'], 2, None),
    "wrong_type_question": ([_j({"id": "b", "question": 7, "golden_answers": ["y"]})], 1, "question"),
    "wrong_type_answers": ([_j({"id": "b", "question": "Q?", "golden_answers": {"a": 1}})], 1, "golden_answers"),
    "not_an_object": ([_j(GOOD_QA), b"[1, 2]\n"], 2, None),
    "missing_id": ([_j({"question": "Q?", "golden_answers": ["y"]})], 1, "id"),
    "nan_answer": ([b'{"id": "b", "question": "Q?", "golden_answers": [NaN]}\n'], 1, "golden_answers"),
}


@pytest.mark.parametrize("case", sorted(BAD_QA))
def test_qa_loader_names_file_line_and_field(tmp_path: Path, case: str) -> None:
    lines, row, field = BAD_QA[case]
    path = _write(tmp_path / "qa.jsonl", lines)
    with pytest.raises(DataError) as err:
        load_qa(path)
    assert err.value.path == str(path)
    assert err.value.row == row
    if field:
        assert err.value.field == field
    assert f"{path}:{row}" in err.value.one_line()


def test_qa_loader_can_skip_and_count(tmp_path: Path) -> None:
    lines = [_j(GOOD_QA), b"not json\n", _j({"id": "c", "question": "Q?", "golden_answers": []}),
             _j({"id": "d", "question": "Q2?", "golden_answers": ["z"]})]
    path = _write(tmp_path / "qa.jsonl", lines)
    stats = ReadStats(str(path))
    items = load_qa(path, skip_bad=True, stats=stats)
    assert [i.id for i in items] == ["a", "d"]
    assert [r for r, _ in stats.skipped] == [2, 3]
    assert stats.rows == 2


def test_empty_qa_file_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path / "qa.jsonl", [])
    with pytest.raises(DataError, match="no questions"):
        load_qa(path)


def test_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="file not found"):
        list(iter_corpus(tmp_path / "nope.jsonl"))


def test_corpus_streams_gzip_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl.gz"
    with gzip.open(path, "wb") as fh:
        fh.write(_j(GOOD_DOC) + _j({"id": 2, "contents": "T2\nmore"}) + _j({"id": "3", "contents": ""}))
    it = iter_corpus(path)
    assert next(it).title == "Title"
    assert next(it).id == "2"  # integer ids become strings
    with pytest.raises(DataError) as err:
        next(it)
    assert err.value.row == 3 and err.value.field == "contents"


def test_corrupt_gzip_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match="cannot read"):
        list(iter_corpus(path))


def test_line_length_limit(tmp_path: Path) -> None:
    path = _write(tmp_path / "c.jsonl", [_j({"id": "1", "contents": "T\n" + "x" * 5000})])
    with pytest.raises(DataError, match="over the"):
        list(iter_jsonl(path, max_line_bytes=1000))


def test_atomic_path_leaves_old_file_on_error(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half")
        raise RuntimeError("boom")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_atomic_dir_replaces_whole_folder(tmp_path: Path) -> None:
    target = tmp_path / "index"
    target.mkdir()
    (target / "stale").write_text("x")
    with atomic_dir(target) as tmp:
        (tmp / "new").write_text("y")
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    with pytest.raises(ValueError), atomic_dir(target) as tmp:
        (tmp / "partial").write_text("z")
        raise ValueError
    assert sorted(p.name for p in target.iterdir()) == ["new"]


def test_killed_writer_leaves_nothing_half_written(tmp_path: Path) -> None:
    """SIGKILL a process in the middle of write_jsonl: the target never appears."""
    target = tmp_path / "rows.jsonl"
    script = textwrap.dedent(f"""
        import sys, time
        from mempo.io import write_jsonl
        def rows():
            for i in range(10**9):
                if i == 1000:
                    print("mid-write", flush=True)
                    time.sleep(60)
                yield {{"i": i}}
        write_jsonl({str(target)!r}, rows())
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "mid-write"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert not target.exists()
    leftovers = list(tmp_path.iterdir())
    assert all(p.name.startswith(".tmp-") for p in leftovers)  # only an orphan temp, never the target
    write_jsonl(target, [{"i": 1}])
    assert target.read_text() == '{"i": 1}\n'


def _watch_renames(monkeypatch: pytest.MonkeyPatch, target: Path) -> list[bool]:
    """After every rename `atomic_dir` does, record whether `target` exists."""
    import mempo.io as mio

    seen: list[bool] = []
    real_replace, real_exchange = os.replace, getattr(mio, "_exchange", None)

    def replace(src: object, dst: object) -> None:
        real_replace(src, dst)  # type: ignore[arg-type]
        seen.append(target.exists())

    def exchange(a: Path, b: Path) -> None:
        real_exchange(a, b)  # type: ignore[misc]
        seen.append(target.exists())

    monkeypatch.setattr(mio.os, "replace", replace)
    if real_exchange is not None:
        monkeypatch.setattr(mio, "_exchange", exchange)
    return seen


def test_atomic_dir_never_leaves_the_path_empty(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Replacing an existing folder: after each filesystem step the path holds the old or the new one."""
    target = tmp_path / "index"
    target.mkdir()
    (target / "old").write_text("x")
    seen = _watch_renames(monkeypatch, target)
    with atomic_dir(target) as tmp:
        (tmp / "new").write_text("y")
    assert seen and all(seen), seen
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["index"]  # the old folder is gone too


def test_atomic_dir_fallback_recovers_the_old_folder(tmp_path: Path) -> None:
    """Where the filesystem cannot swap two names, a process killed between the two renames
    leaves the old folder aside, and the next writer puts it back before replacing it."""
    from mempo.io import recover_dir

    target = tmp_path / "index"
    target.mkdir()
    (target / "old").write_text("x")
    script = textwrap.dedent(f"""
        import os
        from pathlib import Path
        import mempo.io as mio
        def no_exchange(a, b):
            raise OSError(22, "exchange not supported")
        real_replace = os.replace
        def die_after_first(src, dst):
            real_replace(src, dst)
            os._exit(9)  # killed between moving the old folder aside and the new one in
        mio._exchange = no_exchange
        with mio.atomic_dir({str(target)!r}) as tmp:
            (tmp / "new").write_text("y")
            mio.os.replace = die_after_first
    """)
    proc = subprocess.run([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 9
    assert not target.exists()  # the window the fallback cannot close...
    assert recover_dir(target)  # ...and its repair
    assert sorted(p.name for p in target.iterdir()) == ["old"]
    with atomic_dir(target) as tmp:
        (tmp / "new").write_text("y")
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".old-")]


def test_atomic_dir_fsyncs_every_file_before_the_swap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mempo.io as mio

    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(mio.os, "fsync", fsync)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "sub").mkdir()
        (tmp / "a.bin").write_bytes(b"a")
        (tmp / "sub" / "b.bin").write_bytes(b"b")
        names = {str(tmp / "a.bin"), str(tmp / "sub" / "b.bin"), str(tmp / "sub")}
    assert names <= set(synced), synced


def test_weights_sha256_follows_the_weights_not_the_config(tmp_path):
    from mempo.errors import DataError
    from mempo.io import weights_sha256

    a, b = tmp_path / "a", tmp_path / "b"
    for d, cfg in ((a, '{"transformers_version": "4"}'), (b, '{"transformers_version": "5"}')):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"same weights")
        (d / "config.json").write_text(cfg)
    assert weights_sha256(a) == weights_sha256(b)
    (b / "model.safetensors").write_bytes(b"other weights")
    assert weights_sha256(a) != weights_sha256(b)
    with pytest.raises(DataError, match="no \\*.safetensors or \\*.bin weight file"):
        weights_sha256(tmp_path)
