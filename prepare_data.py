"""
Tokenize a dataset into nanoGPT-style train.bin / val.bin (flat uint16 tokens) plus meta.json.

    python prepare_data.py                     # pycode: the installed torch's .py files, GPT-2 BPE
    python prepare_data.py --tokenizer byte    # the same files, a token per byte (the CPU lab's)
    python prepare_data.py --dataset text --input notes/ book.txt

Into data/<dataset> (gpt2) or data/<dataset>-byte (tokenizer.py). Each file is a document ended by
end-of-text; a hash of its path puts it in train or val. The outputs are written under temporary
names and renamed into place, meta.json (which names the tokenizer) last: a folder is complete iff
it has one. An unchanged build does no work (--force rebuilds).
"""
import argparse
import contextlib
import errno
import hashlib
import importlib.util
import itertools
import json
import os
import platform
import sys
import time
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np

from tokenizer import TOKENIZERS, DataError, get_tokenizer

try:
    import fcntl   # the lock on an output folder (and on a run folder: rundir.py)
except ImportError:   # Windows: no lock
    fcntl = None

DATASETS, SPLITS = ("pycode", "text"), ("train", "val")
VAL_FRACTION = 0.01         # the share of the files that goes to val
TEXT_GLOB = "**/*.txt"      # what an --input folder gives; files named directly always count
LOCK, REPLACING = ".lock", "meta.json.replacing"   # one build at a time; the old meta.json in one
TEMPORARIES = {name: f".{name}.tmp" for name in ("train.bin", "val.bin", "meta.json")}
UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}
CHUNK_BYTES = 8 << 20       # text per encode batch, whose token lists take ~10x its size
# The default dataset: the .py files of the torch the README pins, and the content hash they give
PYCODE_IDENTITY = {"torch": "2.13.0", "content_sha256": "61ed56792b68543464c21ced9ba8f3a1"
                                                        "04a47a1e4b810b2a3724321bb45de900"}
FORMAT = 2                  # bump on an output change, voiding old fingerprints (2: tokenizers)
REPO_DIR = os.path.dirname(os.path.abspath(__file__))


def default_out_dir(dataset, tokenizer="gpt2"):
    """data/<dataset> for GPT-2's BPE, data/<dataset>-byte for bytes, next to this file."""
    return os.path.join(REPO_DIR, "data", dataset if tokenizer == "gpt2" else f"{dataset}-byte")


def split_of(rel_path, val_fraction):
    """'train' or 'val' by a sha256 of its path under its root: the same anywhere (not hash())."""
    digest = hashlib.sha256(rel_path.replace(os.sep, "/").encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2**64 else "train"


def pycode_files():
    """(path, rel) of the installed torch's .py files, rel from site-packages, sorted. Only torch's:
    the README pins it, so machines set up as it says train on the same files (others vary)."""
    spec = importlib.util.find_spec("torch")     # found, not imported: no second of import time
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"--dataset pycode is the .py files of torch, which is not installed: "
                        f"`pip install torch=={PYCODE_IDENTITY['torch']}` (README)")
    package = os.path.realpath(list(spec.submodule_search_locations)[0])
    found = [os.path.join(folder, name) for folder, subfolders, names in os.walk(package)
             for name in names if name.endswith(".py") and "__pycache__" not in folder]
    return sorted((path, os.path.relpath(path, os.path.dirname(package))) for path in found)


def check_pycode_identity(meta):
    """One line when a pycode build is not the one the README's numbers came from, and why."""
    torch_version, expected = meta.get("versions", {}).get("torch"), PYCODE_IDENTITY
    other_torch = (torch_version or "").split("+")[0] != expected["torch"]   # 2.13.0+cpu: no tag
    if other_torch or meta.get("content_sha256") != expected["content_sha256"]:
        why = f"torch {expected['torch']}'s .py files" if other_torch \
            else f"the README's {expected['content_sha256']}"
        return (f"note: pycode from torch {torch_version} (content hash "
                f"{meta.get('content_sha256')}) is not {why}: runs train on other data than the "
                f"README's and lab/results'")


def text_files(inputs, pattern=TEXT_GLOB):
    """(path, rel) of the files named in inputs, and of those matching pattern in its folders."""
    found = {}
    for given in inputs:
        p = Path(given).absolute()
        if p.is_file():
            found.setdefault(os.path.realpath(p), (str(p), p.name))
        elif not p.is_dir():
            raise DataError(f"--input {given}: not a regular file or folder (a device or a pipe): "
                            f"give text files" if p.exists() else f"--input {given}: no such file "
                            f"or folder")
        try:
            matches = [f for f in p.glob(pattern) if f.is_file()] if p.is_dir() else []
        except (ValueError, NotImplementedError) as e:   # an empty or absolute pattern
            raise DataError(f"--glob {pattern!r}: {e}") from None
        for f in matches:
            found.setdefault(os.path.realpath(f), (str(f), f.relative_to(p).as_posix()))
    return sorted(found.values())


def read_meta(out_dir, name="meta.json"):
    """meta.json of a complete dataset, or None (unreadable, not JSON, or not a JSON object)."""
    with contextlib.suppress(OSError, ValueError), open(os.path.join(out_dir, name)) as f:
        meta = json.load(f)
        return meta if isinstance(meta, dict) else None
    return None


def prepare(dataset="pycode", out_dir=None, inputs=None, val_fraction=VAL_FRACTION, workers=None,
            force=False, glob=TEXT_GLOB, tokenizer="gpt2"):
    """Build (or find up to date) the tokenized dataset; returns its folder (default_out_dir)."""
    for refused, why in (   # the first that applies is said
            (dataset not in DATASETS, f"unknown dataset {dataset!r}; choose one of {DATASETS}"),
            (tokenizer not in TOKENIZERS, f"unknown tokenizer {tokenizer!r}: {TOKENIZERS}"),
            (not 0 < val_fraction < 1, f"--val-fraction must be between 0 and 1: {val_fraction}"),
            (dataset == "text" and not inputs, "--dataset text needs --input PATH [PATH ...]"),
            (dataset != "text" and inputs, f"--input is only used with --dataset text"),
            ((workers or 0) < 0, f"--workers {workers}: give 0 (all cores) or a thread count")):
        if refused:
            raise DataError(why)
    out_dir = out_dir or default_out_dir(dataset, tokenizer)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"{out_dir} is a file: give a folder for the dataset")
    # a folder holding data this build would not remake is left alone: .bin files nobody vouches
    # for, or another dataset (--force replaces it); REPLACING: a build of ours stopped midway
    held = [n for n in ("train.bin", "val.bin", "meta.json") if os.path.exists(f"{out_dir}/{n}")]
    meta = read_meta(out_dir) or read_meta(out_dir, REPLACING)
    if held and meta is None:
        raise DataError(f"{out_dir} holds {', '.join(held)} but no readable meta.json, so it is "
                        f"left alone (--force too): move them away, or give another --out-dir")
    if meta is not None and meta.get("dataset") != dataset and not force:
        raise DataError(f"{out_dir} holds the {meta.get('dataset')} dataset, not {dataset}: give "
                        f"another --out-dir (or --force to replace it)")
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, LOCK), "a") as lock:   # one build at a time: others wait
            if fcntl:
                fcntl.flock(lock, fcntl.LOCK_EX)
            workers = max(1, workers or os.cpu_count() or 1)
            return _build(dataset, out_dir, inputs, val_fraction, workers, force, glob, tokenizer)
    except OSError as e:
        if e.errno not in UNWRITABLE:
            raise
        raise DataError(f"cannot write the dataset into {out_dir}: {e.strerror}: free space there, "
                        f"or give a writable folder") from None


def _build(dataset, out_dir, inputs, val_fraction, workers, force, glob, tokenizer):
    t0, options = time.time(), {"val_fraction": val_fraction, "tokenizer": tokenizer}
    options.update({"glob": glob} if dataset == "text" else {})
    sources = []
    for path, rel in pycode_files() if dataset == "pycode" else text_files(inputs, glob):
        with contextlib.suppress(OSError):   # a broken link or no permission: not a source
            st = os.stat(path)
            sources.append(dict(path=path, rel=rel, size=st.st_size, mtime_ns=st.st_mtime_ns))
    if not sources:
        raise DataError(f"no source files for {dataset} (inputs {inputs}, glob {glob})")
    # up to date: the same options and sources (path, size, mtime: it reads no file), whole bins
    h = hashlib.sha256(json.dumps([FORMAT, dataset, options], sort_keys=True).encode())
    for s in sources:
        h.update(f"{s['path']}\0{s['size']}\0{s['mtime_ns']}\n".encode())
    fingerprint, old = h.hexdigest()[:32], read_meta(out_dir)
    bins = {split: os.path.join(out_dir, f"{split}.bin") for split in SPLITS}
    whole = old and all(os.path.isfile(b) and os.path.getsize(b) == 2 * old["tokens"][s]   # uint16
                        for s, b in bins.items())
    if not force and whole and old.get("fingerprint") == fingerprint:
        print(f"{out_dir}: up to date ({old['tokens']}); --force rebuilds")
        return out_dir
    enc, records, skipped = get_tokenizer(tokenizer), [], []
    print(f"tokenizing {dataset} ({len(sources):,} files, {tokenizer} tokens) into {out_dir}")
    tmp = {name: os.path.join(out_dir, temporary) for name, temporary in TEMPORARIES.items()}
    try:
        with open(tmp["train.bin"], "wb") as train, open(tmp["val.bin"], "wb") as val:
            docs = _documents(sources, val_fraction, records, skipped)
            counts, ndocs = _tokenize(docs, {"train": train, "val": val}, enc, workers)
        if not sum(ndocs.values()):
            raise DataError(f"no readable text in {dataset}'s files ({len(skipped)} skipped)")
        content = "".join(f"{r['sha256']} {r['split']} {r['rel']}\n" for r in records)
        _publish(out_dir, tmp, {
            "dataset": dataset, "options": options, "tokens": counts, "documents": ndocs,
            "tokenizer": tokenizer, "vocab_size": enc.n_vocab, "eot_token": enc.eot_token,
            "dtype": "uint16", "fingerprint": fingerprint,   # of paths, sizes, mtimes and options
            "content_sha256": hashlib.sha256(content.encode()).hexdigest(),   # what they hold
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "seconds": round(time.time() - t0, 2), "versions": {
                "format": FORMAT, "python": platform.python_version(), "numpy": np.__version__,
                "tiktoken": version("tiktoken"),
                **({"torch": version("torch")} if dataset == "pycode" else {})},
            "skipped": skipped, "sources": records})
    finally:   # however it ends (Ctrl-C too), what it began goes: the folder is as it was
        for path in tmp.values():
            with contextlib.suppress(OSError):
                os.remove(path)
    print(f"{dataset} -> {out_dir}: {counts} tokens, {ndocs} documents, {time.time() - t0:.0f} s")
    for split in [s for s in SPLITS if not ndocs[s]]:
        print(f"warning: the {split} split is empty; use more files or another --val-fraction",
              file=sys.stderr)
    note = check_pycode_identity(read_meta(out_dir)) if dataset == "pycode" else None
    if note:
        print(note, file=sys.stderr)
    return out_dir


def _documents(sources, val_fraction, records, skipped):
    """(split, bytes) of each readable text file, its hash recorded; binary ones are skipped."""
    for s in sources:
        data = None
        with contextlib.suppress(OSError):
            data = Path(s["path"]).read_bytes()
        if data is None or b"\0" in data:   # unreadable or binary: listed in meta.json
            skipped.append(s["path"])
            continue
        split = split_of(s["rel"], val_fraction)
        records.append({"path": s["path"], "rel": s["rel"], "bytes": len(data), "split": split,
                        "sha256": hashlib.sha256(data).hexdigest()})
        yield split, data


def _tokenize(docs, files, enc, workers):
    """Encode documents in batches of about CHUNK_BYTES, appending each one's tokens and an
    end-of-text to its split's file (fsynced at the end); returns tokens and documents per split."""
    counts, ndocs, batch, size = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0), [], 0
    for doc in itertools.chain(docs, [None]):   # None: the end, which writes the last batch
        if doc is not None:
            batch.append(doc)
            size += len(doc[1])
        if batch and (doc is None or size >= CHUNK_BYTES):
            encoded = enc.encode_batch([data for _, data in batch], workers)
            for split in SPLITS:
                parts = [np.asarray(p, np.uint16) for (s, _), tokens in zip(batch, encoded)
                         if s == split for p in (tokens, [enc.eot_token])]
                _write_tokens(files[split], np.concatenate(parts or [np.zeros(0, np.uint16)]))
                counts[split] += sum(map(len, parts))
                ndocs[split] += len(parts) // 2
            batch, size = [], 0
    for f in files.values():
        f.flush()
        os.fsync(f.fileno())
    return counts, ndocs


def _write_tokens(f, tokens):
    f.write(memoryview(tokens))


def _publish(out_dir, tmp, meta):
    """Move the finished temporaries into place. meta.json goes first out (as REPLACING, which says
    the folder is ours) and last in: none says the folder is complete while the bins are swapped."""
    head = json.dumps({k: v for k, v in meta.items() if k != "sources"}, indent=2)
    sources = ",\n".join("    " + json.dumps(s) for s in meta["sources"])
    with open(tmp["meta.json"], "w") as f:   # indented, a line per source: thousands stay readable
        f.write(f'{head[:-2]},\n  "sources": [\n{sources}\n  ]\n}}\n')
        f.flush()
        os.fsync(f.fileno())
    with contextlib.suppress(FileNotFoundError):
        os.replace(os.path.join(out_dir, "meta.json"), os.path.join(out_dir, REPLACING))
    for name in ("train.bin", "val.bin", "meta.json"):
        os.replace(tmp[name], os.path.join(out_dir, name))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, REPLACING))
    with contextlib.suppress(OSError):   # make the renames durable; Windows cannot open a folder
        fd = os.open(out_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


def foreign_files(out_dir):
    """What in out_dir a stopped build of ours did not leave (its lock, temporaries; with REPLACING,
    everything), sorted: train.py prepares data only into a folder where this is empty."""
    names = set(os.listdir(out_dir)) if os.path.isdir(out_dir) else set()
    return [] if REPLACING in names else sorted(names - {LOCK, *TEMPORARIES.values()})


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", choices=DATASETS, default="pycode", help="default pycode (above)")
    p.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2", help="default gpt2 (above)")
    p.add_argument("--out-dir", help="output folder (default data/<dataset>[-byte] by this file)")
    p.add_argument("--input", nargs="+", metavar="PATH", dest="inputs", help="text: files, folders")
    p.add_argument("--glob", default=TEXT_GLOB, help=f"text: a folder's files ({TEXT_GLOB})")
    p.add_argument("--val-fraction", type=float, default=VAL_FRACTION, help="share of files in val")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer threads (0: all)")
    p.add_argument("--force", action="store_true", help="rebuild even if up to date")
    try:
        prepare(**vars(p.parse_args(argv)))
    except DataError as e:
        p.error(str(e.code))
    except KeyboardInterrupt:   # the build removed what it had begun
        sys.exit("stopped: nothing half-made is left; run the command again to build the dataset")


if __name__ == "__main__":
    main()
