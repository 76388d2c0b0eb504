"""lab.keep: a sweep's finished runs kept as results/ holds them, byte for byte the same when kept twice,
never over a different run, and the report reads what it kept as it read the sweep."""

import json
import os

import pytest

from lab import keep, sweep


def fake_run(root, arm, seed, status="completed", loss=2.5):
    """A run folder as train.py leaves it: config, log (start, a step, an end record unless None), a checkpoint."""
    d = root / arm / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"args": {"seed": seed, "max_steps": 10}}))
    records = [{"event": "start", "step": 0}, {"step": 9, "loss": loss}]
    if status:
        records.append({"event": "end", "step": 10, "status": status})
    (d / "log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (d / "ckpt.pt").write_bytes(b"not kept")
    return d


def test_keeps_finished_runs_as_gzip_and_lists_the_rest(tmp_path):
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1), fake_run(src, "assay", 1, "collapsed"), fake_run(src, "fp32", 2, status=None)
    (src / "fault_size.json").write_text('{"error_ratio": 0.003}')
    kept, left = keep.keep(str(src), str(dst))
    assert sorted(os.path.relpath(k, dst) for k in kept) == ["assay/seed1", "fp32/seed1"]
    assert left == ["fp32/seed2: no end record"]
    assert sorted(os.listdir(dst / "fp32" / "seed1")) == ["config.json", "log.jsonl.gz"]   # no checkpoint
    assert not (dst / "fp32" / "seed2").exists()
    assert (dst / "fault_size.json").read_text() == '{"error_ratio": 0.003}'
    assert sweep.read_log(str(dst / "fp32" / "seed1")) == sweep.read_log(str(src / "fp32" / "seed1"))
    assert sweep.run_state(str(dst / "assay" / "seed1")) == "collapsed"


def test_whole_seeds_leaves_out_a_seed_unfinished_or_missing_in_any_arm(tmp_path):
    src, dst = tmp_path / "runs", tmp_path / "results"
    for arm in ("fp32", "assay"):
        fake_run(src, arm, 1)
    fake_run(src, "fp32", 2), fake_run(src, "assay", 2, status=None)   # seed 2 unfinished in one arm
    fake_run(src, "fp32", 3)                                           # seed 3 not started in the other
    kept, left = keep.keep(str(src), str(dst), whole_seeds=True)
    assert sorted(os.path.relpath(k, dst) for k in kept) == ["assay/seed1", "fp32/seed1"]
    assert "fp32/seed2: finished, but seed2 is not finished in every arm" in left
    assert "fp32/seed3: finished, but seed3 is not finished in every arm" in left


def test_keeping_twice_gives_the_same_bytes_and_a_different_run_is_refused(tmp_path, monkeypatch):
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1)
    keep.keep(str(src), str(dst))
    first = (dst / "fp32" / "seed1" / "log.jsonl.gz").read_bytes()
    monkeypatch.setattr(keep.gzip.time, "time", lambda: 2e9)          # later: a gzip stamped with the time differs
    keep.keep(str(src), str(dst))                                      # the same run again: no change
    assert (dst / "fp32" / "seed1" / "log.jsonl.gz").read_bytes() == first
    keep.keep(str(dst), str(tmp_path / "again"))                       # kept runs keep as they are
    assert (tmp_path / "again" / "fp32" / "seed1" / "log.jsonl.gz").read_bytes() == first
    other = tmp_path / "other"
    fake_run(other, "fp32", 1, loss=9.9)
    fake_run(other, "bf16", 1)
    with pytest.raises(SystemExit, match="already holds another run"):
        keep.keep(str(other), str(dst))
    assert (dst / "fp32" / "seed1" / "log.jsonl.gz").read_bytes() == first, "nothing lost"
    assert not (dst / "bf16").exists(), "nothing written before the refusal"


def test_cli_refuses_a_missing_folder_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit, match="is not a folder"):
        keep.main([str(tmp_path / "nowhere"), str(tmp_path / "results")])


@pytest.mark.parametrize("which", ["config.json", "fault_size.json"])
def test_a_different_runs_config_or_fault_size_is_refused_even_with_the_same_log(tmp_path, which):
    """A keep that compared only the gzipped log would write over these: the same log, another run."""
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1)
    (src / "fault_size.json").write_text('{"error_ratio": 0.003}')
    keep.keep(str(src), str(dst))
    before = {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()}
    other = tmp_path / "other"
    fake_run(other, "fp32", 1)                                  # the same log bytes
    (other / "fault_size.json").write_text('{"error_ratio": 0.003}')
    if which == "config.json":
        (other / "fp32" / "seed1" / "config.json").write_text(json.dumps({"args": {"seed": 1, "max_steps": 99}}))
    else:
        (other / "fault_size.json").write_text('{"error_ratio": 0.5}')
    with pytest.raises(SystemExit, match=f"already holds another run's {which}"):
        keep.keep(str(other), str(dst))
    assert {p: p.read_bytes() for p in dst.rglob("*") if p.is_file()} == before, "nothing written over"


def test_a_run_whose_config_cannot_be_read_is_left_out_not_kept(tmp_path):
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1)
    fake_run(src, "fp32", 2)
    (src / "fp32" / "seed2" / "config.json").write_text('{"args": {"seed"')   # cut short
    kept, left = keep.keep(str(src), str(dst))
    assert [os.path.relpath(k, dst) for k in kept] == ["fp32/seed1"]
    assert left == ["fp32/seed2: config.json missing or not JSON"]
    assert not (dst / "fp32" / "seed2").exists()


def test_a_keep_leaves_no_temporary_files_and_refuses_a_file_for_the_destination(tmp_path):
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1)
    keep.keep(str(src), str(dst))
    assert not list(dst.rglob("*.tmp"))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match="is a file"):
        keep.main([str(src), str(tmp_path / "afile")])


def test_a_kept_gzip_cut_short_is_called_damaged_not_another_run(tmp_path):
    """A keep killed while writing (before writes were atomic), or a copy cut short, left half a gzip; the next
    keep blamed "a different run" for it."""
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1)
    keep.keep(str(src), str(dst))
    log = dst / "fp32" / "seed1" / "log.jsonl.gz"
    log.write_bytes(log.read_bytes()[:len(log.read_bytes()) // 2])
    with pytest.raises(SystemExit) as e:
        keep.keep(str(src), str(dst))
    assert str(e.value).startswith(f"error: {log} is damaged (not a whole gzip: ") and "another run" not in str(e.value)
    assert str(e.value).endswith("remove it (or restore it from git) and keep again")
    (dst / "fp32" / "seed1" / "config.json").write_text('{"args": {"se')      # a config cut short, too
    log.unlink()
    with pytest.raises(SystemExit, match=r"config.json is damaged \(not JSON: "):
        keep.keep(str(src), str(dst))


def test_an_interrupted_keeps_temp_files_are_removed_and_no_others(tmp_path):
    """A keep killed between writing a temp file and renaming it leaves <file>.tmp: keep's own, removed by the next
    keep, wherever it lies (its run may since be left out); a .tmp keep never writes is not its to remove."""
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1)
    for leftover in ("fp32/seed1/config.json.tmp", "fp32/seed2/log.jsonl.gz.tmp", "fault_size.json.tmp"):
        (dst / leftover).parent.mkdir(parents=True, exist_ok=True)
        (dst / leftover).write_bytes(b"half")
    (dst / "notes.tmp").write_text("someone's")
    keep.keep(str(src), str(dst))
    assert [p.relative_to(dst).as_posix() for p in dst.rglob("*.tmp")] == ["notes.tmp"]
    assert keep.keep(str(src), str(dst))[0] == [str(dst / "fp32" / "seed1")]   # the kept run as it was


def test_a_file_above_the_destination_is_one_line(tmp_path):
    src = tmp_path / "runs"
    fake_run(src, "fp32", 1)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(SystemExit, match=f"error: {tmp_path / 'afile' / 'below'}: {tmp_path / 'afile'} is a file"):
        keep.main([str(src), str(tmp_path / "afile" / "below")])
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "fp32").write_text("x")          # a file where a run's folder goes
    with pytest.raises(SystemExit, match="error: cannot write .*results/fp32"):
        keep.main([str(src), str(tmp_path / "results")])


def test_a_folder_where_a_kept_file_goes_is_one_line_and_nothing_is_kept(tmp_path):
    # before: IsADirectoryError's traceback
    src, dst = tmp_path / "runs", tmp_path / "results"
    fake_run(src, "fp32", 1), fake_run(src, "fp32", 2)
    (dst / "fp32" / "seed2" / "config.json").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        keep.keep(str(src), str(dst))
    assert str(e.value) == (f"error: {dst / 'fp32' / 'seed2' / 'config.json'} is a folder where a kept run's "
                            f"config.json goes: move it away (nothing was kept), and keep again")
    assert not (dst / "fp32" / "seed1").exists()
