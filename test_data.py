"""Tests of prepare_data.py on small temporary folders (the full pycode set is too slow for a test).

    TIKTOKEN_CACHE_DIR=/path/to/tiktoken_cache python -m pytest -q test_data.py
"""
import argparse
import errno
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import tiktoken

import prepare_data as prep
import tokenizer

EOT = 50256
FILES = {  # rel path -> text: unicode, a literal special-token string, an empty file, a subfolder
    "a.txt": "hello world",
    "b.txt": "def f(x):\n    return x  # ünïcödé ✓ 漢字\n",
    "c.txt": "text that mentions <|endoftext|> is still ordinary text\n",
    "empty.txt": "",
    "sub/d.txt": "nested\n\tfile\r\n",
    "sub/e.txt": "more " * 100,
}
for i in range(20):
    FILES[f"many/f{i:02d}.txt"] = f"file number {i}\n"


def make_files(root, files=FILES):
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text.encode("utf-8"))
    return root


def load(out_dir, split):
    return np.fromfile(os.path.join(out_dir, f"{split}.bin"), dtype=np.uint16)  # memmap fails on an empty file


def build(tmp_path, name="out", **kw):
    src = tmp_path / "src"
    if not src.exists():
        make_files(src)
    kw.setdefault("val_fraction", 0.3)
    return prep.prepare("text", out_dir=str(tmp_path / name), inputs=[str(src)], workers=2, **kw)


def test_known_tokens(tmp_path):
    enc = tiktoken.get_encoding(tokenizer.GPT2_ENCODING)
    assert enc.encode_ordinary("hello world") == [31373, 995]
    assert enc.eot_token == EOT and enc.n_vocab == 50257
    make_files(tmp_path / "src", {"hello.txt": "hello world"})
    out = prep.prepare("text", out_dir=str(tmp_path / "out"), inputs=[str(tmp_path / "src")], val_fraction=1e-9)
    assert load(out, "train").tolist() == [31373, 995, EOT]
    assert len(load(out, "val")) == 0


def test_round_trip_and_meta(tmp_path):
    out = build(tmp_path)
    meta = prep.read_meta(out)
    enc = tiktoken.get_encoding("r50k_base")
    assert [meta[k] for k in ("tokenizer", "vocab_size", "eot_token", "dtype")] == ["gpt2", 50257, EOT, "uint16"]
    assert sorted(s["rel"] for s in meta["sources"]) == sorted(FILES)
    for split in prep.SPLITS:
        tokens = load(out, split)
        assert os.path.getsize(os.path.join(out, f"{split}.bin")) == 2 * meta["tokens"][split] == 2 * len(tokens)
        # each file's tokens, then one EOT; a literal "<|endoftext|>" in c.txt is not token 50256
        docs = np.split(np.asarray(tokens), np.flatnonzero(tokens == EOT) + 1)[:-1]
        sources = [s for s in meta["sources"] if s["split"] == split]
        assert len(docs) == len(sources) == meta["documents"][split]
        for doc, s in zip(docs, sources):
            assert doc[-1] == EOT
            assert enc.decode(doc[:-1].tolist()) == FILES[s["rel"]]
    assert meta["documents"]["train"] > 0 and meta["documents"]["val"] > 0
    for s in meta["sources"]:  # provenance: per-source size, split and content hash
        data = (tmp_path / "src" / s["rel"]).read_bytes()
        assert s["bytes"] == len(data) and s["sha256"] == hashlib.sha256(data).hexdigest()
        assert s["split"] == prep.split_of(s["rel"], 0.3)
    lines = "".join(f"{s['sha256']} {s['split']} {s['rel']}\n" for s in meta["sources"])
    assert meta["content_sha256"] == hashlib.sha256(lines.encode()).hexdigest()
    assert meta["options"] == {"val_fraction": 0.3, "tokenizer": "gpt2", "glob": prep.TEXT_GLOB} and meta["fingerprint"]


def test_byte_tokens_give_every_file_back_byte_for_byte(tmp_path):
    # One token per byte and an end-of-text token (256) after each file: every file's bytes come
    # back exactly, non-UTF-8 files included (GPT-2's BPE replaces their bad bytes with U+FFFD).
    files = {rel: text.encode("utf-8") for rel, text in FILES.items()}
    files.update({"latin1.txt": "café, naïve\n".encode("latin-1"), "bad.txt": b"\x80\xff\xfe lone bytes \xc3",
                  "crlf.txt": b"a\r\nb\r\n", "high/all.txt": bytes(range(1, 256))})
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    out = prep.prepare("text", out_dir=str(tmp_path / "out"), inputs=[str(src)], val_fraction=0.3,
                       tokenizer="byte")
    meta = prep.read_meta(out)
    assert [meta[k] for k in ("tokenizer", "vocab_size", "eot_token", "dtype")] == ["byte", 257, 256, "uint16"]
    assert meta["options"]["tokenizer"] == "byte"
    enc = tokenizer.get_tokenizer("byte")
    seen = set()
    for split in prep.SPLITS:
        tokens = load(out, split)
        docs = np.split(tokens, np.flatnonzero(tokens == 256) + 1)[:-1]
        sources = [s for s in meta["sources"] if s["split"] == split]
        assert len(docs) == len(sources) == meta["documents"][split]
        for doc, s in zip(docs, sources):
            assert doc[-1] == 256 and doc[:-1].max(initial=0) < 256
            assert bytes(doc[:-1].astype(np.uint8)) == files[s["rel"]], s["rel"]
            seen.add(s["rel"])
    assert seen == set(files)
    assert enc.decode(enc.encode("def f(x): ✓")) == "def f(x): ✓" and enc.decode([104, 105, 256]) == "hi"


def test_each_tokenizer_has_its_own_folder_and_fingerprint(tmp_path, capsys):
    assert prep.default_out_dir("pycode", "gpt2").endswith(os.path.join("data", "pycode"))
    assert prep.default_out_dir("pycode", "byte").endswith(os.path.join("data", "pycode-byte"))
    out = build(tmp_path)
    capsys.readouterr()
    build(tmp_path, tokenizer="byte")  # same sources, another tokenizer: rebuilt, not "up to date"
    assert "up to date" not in capsys.readouterr().out and prep.read_meta(out)["tokenizer"] == "byte"
    with pytest.raises(SystemExit, match="unknown tokenizer"):
        build(tmp_path, tokenizer="bpe")


def test_split_is_deterministic_and_honours_fraction(tmp_path):
    names = [f"pkg{i % 37}/module_{i}.py" for i in range(20000)]
    for frac in (0.01, 0.1, 0.5):
        val = sum(prep.split_of(n, frac) == "val" for n in names) / len(names)
        assert abs(val - frac) < 0.25 * frac + 0.003
    # the same in another interpreter with another string-hash seed (Python's hash() would differ)
    code = "import prepare_data as p; print(''.join('v' if p.split_of(f'pkg{i % 37}/module_{i}.py', 0.1) == 'val' " \
           "else 't' for i in range(500)))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=os.path.dirname(os.path.abspath(prep.__file__)), env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert other.stdout.strip() == "".join("v" if prep.split_of(n, 0.1) == "val" else "t" for n in names[:500])
    assert prep.split_of(os.path.join("pkg", "m.py"), 0.3) == prep.split_of("pkg/m.py", 0.3)
    # the same files in another folder, named one by one in reverse order: the same split and bytes
    flat = {f"f{i:03d}.txt": f"doc {i}\n" for i in range(60)}
    a, b = make_files(tmp_path / "a", flat), make_files(tmp_path / "elsewhere" / "b", flat)
    out_a = prep.prepare("text", out_dir=str(tmp_path / "oa"), inputs=[str(a)], val_fraction=0.2)
    out_b = prep.prepare("text", out_dir=str(tmp_path / "ob"), val_fraction=0.2,
                       inputs=[str(p) for p in sorted(b.iterdir(), reverse=True)])
    splits = lambda out: {s["rel"]: s["split"] for s in prep.read_meta(out)["sources"]}
    assert splits(out_a) == splits(out_b) and set(splits(out_a).values()) == {"train", "val"}
    for split in prep.SPLITS:
        assert np.array_equal(load(out_a, split), load(out_b, split))


def test_pycode_discovery():
    files = prep.pycode_files()
    paths = [p for p, _ in files]
    assert paths == sorted(paths) and len(set(paths)) == len(paths)
    assert all(p.endswith(".py") and "__pycache__" not in p for p in paths)
    rels = {rel for _, rel in files}
    assert os.path.join("torch", "__init__.py") in rels and not any(os.path.isabs(r) for r in rels)
    assert all(r.startswith("torch" + os.sep) for r in rels)   # only torch's files: the same on every machine
    val = sum(prep.split_of(r, 0.01) == "val" for r in rels)
    assert 0 < val < 0.03 * len(rels)


def test_pycode_is_the_same_wherever_the_readme_was_followed(tmp_path, capsys):
    # the pinned torch's files give the committed content hash: the README's and the lab's runs
    # can be rerun elsewhere on the same data (and a run records the hash it trained on)
    from importlib.metadata import version
    if version("torch").split("+")[0] != prep.PYCODE_IDENTITY["torch"]:
        pytest.skip(f"torch {version('torch')} is installed, not the README's {prep.PYCODE_IDENTITY['torch']}")
    out = prep.prepare("pycode", out_dir=str(tmp_path / "pycode"), tokenizer="byte", workers=1)
    meta = prep.read_meta(out)
    assert meta["content_sha256"] == prep.PYCODE_IDENTITY["content_sha256"]
    assert meta["versions"]["torch"] == version("torch") and prep.check_pycode_identity(meta) is None
    assert "note: pycode" not in capsys.readouterr().err
    assert "not torch 2.13.0's" in prep.check_pycode_identity({**meta, "versions": {"torch": "2.11.0"}})
    assert "content hash x" in prep.check_pycode_identity({**meta, "content_sha256": "x"})


def test_the_byte_tokenizer_gives_every_byte_value_back():
    enc = tokenizer.ByteTokenizer()
    every = bytes(range(256))
    assert enc.decode_bytes([*every, enc.eot_token]) == every          # end-of-text dropped, all else kept
    text = "".join(map(chr, range(1, 0x800))) + "漢字✓\U0001F600"       # 1- to 4-byte UTF-8
    assert enc.encode(text) == list(text.encode()) and enc.decode(enc.encode(text)) == text
    assert all(0 <= t < 256 for t in enc.encode(text))


def test_a_folder_holding_other_data_is_never_written_over(tmp_path):
    # bins without meta.json: nobody knows what they hold; another dataset: only with --force
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "train.bin").write_bytes(b"\1\0" * 10)
    with pytest.raises(SystemExit, match="no readable meta.json.*left alone"):
        prep.prepare("text", out_dir=str(mine), inputs=[str(tmp_path)], val_fraction=0.3, force=True)
    (mine / "meta.json").write_text("[1]")   # JSON but no dataset description: read as none (it crashed)
    with pytest.raises(SystemExit, match=r"no readable meta.json, so it is left alone \(--force too\): move"):
        prep.prepare("text", out_dir=str(mine), inputs=[str(tmp_path)], val_fraction=0.3, force=True)
    (mine / "meta.json").unlink()
    assert (mine / "train.bin").read_bytes() == b"\1\0" * 10 and sorted(os.listdir(mine)) == ["train.bin"]
    out = build(tmp_path)
    before = {n: (tmp_path / "out" / n).read_bytes() for n in os.listdir(out)}
    with pytest.raises(SystemExit, match="holds the text dataset, not pycode"):
        prep.prepare("pycode", out_dir=out, tokenizer="byte")
    assert {n: (tmp_path / "out" / n).read_bytes() for n in os.listdir(out)} == before


def test_an_out_dir_that_is_a_file_ends_in_one_line(tmp_path):
    (tmp_path / "file").write_text("mine")
    r = subprocess.run([sys.executable, prep.__file__, "--dataset", "text", "--input", str(tmp_path),
                        "--out-dir", str(tmp_path / "file")], capture_output=True, text=True)
    assert r.returncode != 0 and "is a file: give a folder" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "file").read_text() == "mine"


def test_rerun_does_no_work(tmp_path, capsys, monkeypatch):
    out = build(tmp_path)
    train = os.path.join(out, "train.bin")
    stamp = os.stat(train).st_mtime_ns
    capsys.readouterr()
    with monkeypatch.context() as m:
        m.setattr(prep, "_tokenize", lambda *a, **k: pytest.fail("tokenized again"))
        build(tmp_path)
    assert "up to date" in capsys.readouterr().out
    assert os.stat(train).st_mtime_ns == stamp
    (tmp_path / "src" / "a.txt").write_text("hello there, world")  # a changed source redoes it
    build(tmp_path)
    assert "up to date" not in capsys.readouterr().out
    tokens = load(out, "train").tolist() + load(out, "val").tolist()
    assert "hello there, world" in tiktoken.get_encoding("r50k_base").decode(tokens), "the new text is in"
    build(tmp_path, force=True)  # --force too
    assert "up to date" not in capsys.readouterr().out
    build(tmp_path, val_fraction=0.5)  # and so do other options
    assert "up to date" not in capsys.readouterr().out
    assert prep.read_meta(out)["options"]["val_fraction"] == 0.5


def snapshot(out):
    return {name: open(os.path.join(out, name), "rb").read() for name in sorted(os.listdir(out)) if name != ".lock"}


def test_crash_while_writing_keeps_old_dataset(tmp_path, monkeypatch):
    out = build(tmp_path)
    good = snapshot(out)
    (tmp_path / "src" / "b.txt").write_text("changed " * 50)
    real = prep._write_tokens

    def write_then_crash(f, tokens):
        real(f, tokens)
        f.flush()
        assert os.path.getsize(f.name) > 0  # the temporary file has been written
        raise RuntimeError("simulated crash")
    monkeypatch.setattr(prep, "_write_tokens", write_then_crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        build(tmp_path)
    assert snapshot(out) == good  # the previous dataset is intact, and no temporary files are left


def test_crash_while_publishing_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    out = build(tmp_path)
    (tmp_path / "src" / "b.txt").write_text("changed " * 50)
    real, calls = os.replace, []

    def replace_then_crash(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("simulated crash")
        real(src, dst)
    monkeypatch.setattr(os, "replace", replace_then_crash)
    with pytest.raises(OSError, match="simulated crash"):
        build(tmp_path)
    monkeypatch.undo()
    assert prep.read_meta(out) is None  # train.bin new, val.bin old: no meta.json may vouch for it
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]
    build(tmp_path)  # the next run repairs it
    meta = prep.read_meta(out)
    assert all(len(load(out, s)) == meta["tokens"][s] for s in prep.SPLITS)


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "text", "--input", "/no/such/path"], "/no/such/path: no such file or folder"),
    (["--dataset", "text"], "--dataset text needs --input"),
    (["--input", "x.txt"], "--input is only used with --dataset text"),
    (["--val-fraction", "1.5"], "must be between 0 and 1"),
    (["--val-fraction", "0"], "must be between 0 and 1"),
    (["--dataset", "text", "--input", ".", "--glob", "/abs/*.txt"], "--glob '/abs/*.txt'"),
    (["--dataset", "text", "--input", "/dev/zero"], "/dev/zero: not a regular file or folder"),
])
def test_bad_input_exits_with_message(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        prep.main(argv + ["--out-dir", str(tmp_path / "out")])
    assert e.value.code != 0 and message in capsys.readouterr().err


def test_bad_input_from_the_command_line(tmp_path):
    (tmp_path / "empty").mkdir()
    for args, message in [(["--input", str(tmp_path / "missing")], "no such file or folder"),
                          (["--input", str(tmp_path / "empty")], "no source files")]:
        cmd = [sys.executable, prep.__file__, "--dataset", "text", "--out-dir", str(tmp_path / "o"), *args]
        r = subprocess.run(cmd, capture_output=True, text=True)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr
    with pytest.raises(SystemExit, match="val-fraction"):  # the API too, not only the CLI
        prep.prepare("text", inputs=[str(tmp_path)], val_fraction=1.0)


# A build stopped midway: the tokenizer's first write sends the signal to its own process.
STOP_MIDWAY = """import os, signal, sys
import prepare_data as prep
prep._write_tokens = lambda f, tokens: os.kill(os.getpid(), getattr(signal, sys.argv[1]))
prep.prepare("text", out_dir=sys.argv[2], inputs=[sys.argv[3]], val_fraction=0.3, workers=1)
"""


def stop_midway(tmp_path, sig):
    out, src = tmp_path / "out", make_files(tmp_path / "src")
    r = subprocess.run([sys.executable, "-c", STOP_MIDWAY, sig, str(out), str(src)], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.abspath(prep.__file__)))
    assert r.returncode != 0 and out.is_dir(), r.stderr
    return out


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_stopped_first_build_leaves_nothing_that_a_later_run_refuses(tmp_path, sig):
    import run
    out = stop_midway(tmp_path, sig)
    left = {".lock"} if sig == "SIGINT" else {".lock", ".train.bin.tmp", ".val.bin.tmp"}
    assert set(os.listdir(out)) == left, "Ctrl-C removes its temporaries; a kill leaves them to the next"
    assert prep.foreign_files(str(out)) == [], "what it leaves is its own: train.py prepares there"
    with pytest.raises(SystemExit, match="no prepared data"):     # not "holds ...: it is left alone"
        run.ensure_data(argparse.Namespace(data_dir=str(out), dataset="text", tokenizer="gpt2"), None)


def test_a_killed_builds_lock_and_temporaries_are_its_own_and_the_next_build_removes_them(tmp_path):
    out = stop_midway(tmp_path, "SIGKILL")
    assert ".lock" in os.listdir(out) and prep.foreign_files(str(out)) == [], os.listdir(out)
    (out / "notes.txt").write_text("mine")
    assert prep.foreign_files(str(out)) == ["notes.txt"], "anything else is not prepare_data's"
    build(tmp_path)
    assert sorted(os.listdir(out)) == [".lock", "meta.json", "notes.txt", "train.bin", "val.bin"]
    assert (out / "notes.txt").read_text() == "mine"
    (out / prep.REPLACING).write_text("{}")   # a build stopped while publishing: all of it is its own
    assert prep.foreign_files(str(out)) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_full_or_read_only_disk_ends_in_one_line_naming_the_folder(tmp_path, monkeypatch, code):
    def fail(f, tokens):
        raise OSError(code, os.strerror(code))
    monkeypatch.setattr(prep, "_write_tokens", fail)
    with pytest.raises(SystemExit, match=f"cannot write the dataset into {tmp_path / 'out'}: {os.strerror(code)}"):
        build(tmp_path)
    assert os.listdir(tmp_path / "out") == [".lock"], "nothing half-written is left (the lock stays)"


def test_an_out_dir_under_a_file_ends_in_one_line(tmp_path):
    (tmp_path / "file").write_text("mine")
    with pytest.raises(SystemExit, match=f"cannot write the dataset into {tmp_path / 'file' / 'sub'}"):
        prep.prepare("text", out_dir=str(tmp_path / "file" / "sub"), inputs=[str(tmp_path)])
    assert (tmp_path / "file").read_text() == "mine"


def test_gpt2_bpe_offline_says_how_to_get_it(tmp_path):
    make_files(tmp_path / "src")
    (tmp_path / "empty_cache").mkdir()
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty_cache"),   # and no network:
           "HTTPS_PROXY": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9", "NO_PROXY": "", "no_proxy": ""}
    r = subprocess.run([sys.executable, prep.__file__, "--dataset", "text", "--input", str(tmp_path / "src"),
                        "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "TIKTOKEN_CACHE_DIR" in r.stderr.splitlines()[-1] and "--tokenizer byte" in r.stderr.splitlines()[-1]


def test_a_data_dir_that_is_a_file_is_called_a_file_not_an_out_dir(tmp_path):
    import types
    import run
    (tmp_path / "file").write_text("mine")
    args = argparse.Namespace(data_dir=str(tmp_path / "file"), dataset="pycode", tokenizer="byte")
    with pytest.raises(SystemExit) as e:     # train.py --data-dir FILE, on its first run
        run.ensure_data(args, types.SimpleNamespace(local_rank=0, barrier=lambda: None))
    assert "is a file: give a folder" in str(e.value.code) and "--out-dir" not in str(e.value.code), e.value.code
    assert (tmp_path / "file").read_text() == "mine"
