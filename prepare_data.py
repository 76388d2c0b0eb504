"""
Tokenize a dataset into nanoGPT-style train.bin / val.bin (flat uint16 tokens) plus meta.json.

    python prepare_data.py                        # pycode: the installed torch's .py files, GPT-2 BPE
    python prepare_data.py --tokenizer byte       # the same files, one token per byte (a CPU's lab)
    python prepare_data.py --dataset text --input notes/ book.txt
    python prepare_data.py --dataset shakespeare  # downloads 1 MB
    python prepare_data.py --dataset owt          # needs `pip install datasets`, network, ~55 GB

Tokenizers (--tokenizer): gpt2, GPT-2's BPE (50,257 tokens, the paper's setting; data/<dataset>), and
byte, one token per byte plus end-of-text (257 tokens; data/<dataset>-byte). Bytes make a CPU lab fast:
at GPT-2's vocabulary the output layer is most of a small model's step (lab/MEASUREMENTS.md). meta.json
names the tokenizer and its vocabulary; train.py sizes the model from it. Read a split as nanoGPT does:
np.memmap("data/pycode/train.bin", dtype=np.uint16, mode="r"). Every document (a source file; each of
shakespeare's two parts) ends with the end-of-text token. A folder is complete iff its meta.json exists:
outputs are written under temporary names, fsynced and renamed into place, meta.json last. Re-runs on
unchanged inputs do no work; --force rebuilds. A stopped build (Ctrl-C, SIGTERM) removes its lock file
and temporaries; after a kill, the next build does.
"""
import argparse
import contextlib
import errno
import hashlib
import importlib.util
import json
import os
import platform
import signal
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone
from importlib.metadata import version
from pathlib import Path

import numpy as np
import tiktoken

try:
    import fcntl  # for the lock on an output folder
except ImportError:  # Windows: no lock
    fcntl = None

# -----------------------------------------------------------------------------
# configuration (the owt and shakespeare val fractions are nanoGPT's)
DATASETS = ("pycode", "text", "owt", "shakespeare")
VAL_FRACTION = {"pycode": 0.01, "text": 0.01, "owt": 0.0005, "shakespeare": 0.1}
TEXT_GLOB = "**/*.txt"      # what an --input folder contributes; files named directly always count
TOKENIZERS = ("gpt2", "byte")
VOCAB_SIZES = {"gpt2": 50257, "byte": 257}   # each tokenizer's n_vocab (GPT-2's without downloading it)
GPT2_ENCODING = "r50k_base" # GPT-2's BPE; get_encoding("gpt2") needs two more files: fails offline
SPLITS = ("train", "val")
REPLACING = "meta.json.replacing"   # the old meta.json while a rebuild swaps the .bin files
LOCK = ".lock"
TEMPORARIES = {name: f".{name}.tmp" for name in ("train.bin", "val.bin", "meta.json", "input.txt")}
UNWRITABLE = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOTDIR}  # one line
CHUNK_BYTES = 8 << 20       # text per encode batch, whose token lists take ~10x its size in memory
PROGRESS_SECONDS = 2.0
SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
OWT_NAME = "openwebtext"
# The offline default dataset: the .py files of the torch the README pins, and the content hash they give
PYCODE_IDENTITY = {"torch": "2.13.0",
                   "content_sha256": "61ed56792b68543464c21ced9ba8f3a104a47a1e4b810b2a3724321bb45de900"}
FORMAT = 2                  # bump on an output change, voiding old fingerprints (2: tokenizers)
REPO_DIR = os.path.dirname(os.path.abspath(__file__))
# -----------------------------------------------------------------------------


class DataError(SystemExit):
    """Bad input or a missing requirement, a SystemExit: it ends the program with no traceback."""


# -----------------------------------------------------------------------------
# The two tokenizers: documents (bytes or str) to token arrays, and tokens back to text (sample.py).

class ByteTokenizer:
    """One token per byte (0..255) and end-of-text, 256: every file comes back byte for byte, UTF-8
    or not. (A file holding a NUL byte is skipped as binary, so nothing else could be confused.)"""
    n_vocab, eot_token = 257, 256

    def encode_batch(self, docs, workers=1):
        return [np.frombuffer(d.encode() if isinstance(d, str) else d, np.uint8) for d in docs]

    def encode(self, text):
        return list(text.encode())

    def decode_bytes(self, tokens):
        """The bytes back exactly (end-of-text and padding tokens dropped)."""
        return bytes(t for t in tokens if t < 256)

    def decode(self, tokens):
        return self.decode_bytes(tokens).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken. Undecodable bytes become U+FFFD rather than losing the file,
    and "<|endoftext|>" inside a document is plain text, not the special token."""

    def __init__(self):
        try:
            self.enc = tiktoken.get_encoding(GPT2_ENCODING)
        except (OSError, ValueError) as e:  # offline (requests' errors are OSErrors), a damaged download
            raise DataError(f"GPT-2's BPE is not in tiktoken's cache and could not be downloaded ({type(e).__name__}): "
                            "point TIKTOKEN_CACHE_DIR at a folder holding its ranks file (README), or use "
                            "--tokenizer byte") from None
        self.n_vocab, self.eot_token = self.enc.n_vocab, self.enc.eot_token

    def encode_batch(self, docs, workers=1):
        texts = [d if isinstance(d, str) else d.decode("utf-8", errors="replace") for d in docs]
        return self.enc.encode_ordinary_batch(texts, num_threads=workers)

    def encode(self, text):
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def decode(self, tokens):
        return self.enc.decode([t for t in tokens if t < self.n_vocab])


def get_tokenizer(name):
    """The tokenizer a meta.json names."""
    if name not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {name!r}: choose one of {', '.join(TOKENIZERS)}")
    return ByteTokenizer() if name == "byte" else GPT2Tokenizer()


def default_out_dir(dataset, tokenizer="gpt2"):
    """data/<dataset> for GPT-2's BPE, data/<dataset>-byte for bytes, next to this file."""
    return os.path.join(REPO_DIR, "data", dataset if tokenizer == "gpt2" else f"{dataset}-{tokenizer}")


def split_of(rel_path, val_fraction):
    """'train' or 'val' for a file, from a hash of its path relative to its root: the same on any
    machine, folder and file order (Python's hash() is salted per process)."""
    digest = hashlib.sha256(rel_path.replace(os.sep, "/").encode()).digest()
    return "val" if int.from_bytes(digest[:8], "big") < val_fraction * 2**64 else "train"


def pycode_files():
    """(path, rel) of every .py file of the installed torch package, rel from its site-packages
    (torch/nn/...), sorted by path. Only torch's: the README pins its version, so every machine set up as
    the README says trains on the same files (the stdlib and other packages vary); meta.json records it."""
    spec = importlib.util.find_spec("torch")     # found, not imported: no second of import time
    if spec is None or not spec.submodule_search_locations:
        raise DataError(f"--dataset pycode is the .py files of torch, which is not installed: `pip install "
                        f"torch=={PYCODE_IDENTITY['torch']}` (README), or choose another --dataset")
    package, found = os.path.realpath(list(spec.submodule_search_locations)[0]), []
    for dirpath, dirnames, filenames in os.walk(package):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        found += [(os.path.join(dirpath, n), os.path.relpath(os.path.join(dirpath, n), os.path.dirname(package)))
                  for n in filenames if n.endswith(".py")]
    return sorted(found)


def check_pycode_identity(meta):
    """One line when a pycode build is not the one the README's numbers came from, and why."""
    torch_version, expected = meta.get("versions", {}).get("torch"), PYCODE_IDENTITY
    other_torch = (torch_version or "").split("+")[0] != expected["torch"]    # 2.13.0+cpu: the build tag aside
    if other_torch or meta.get("content_sha256") != expected["content_sha256"]:
        why = f"torch {expected['torch']}'s .py files" if other_torch else f"the README's {expected['content_sha256']}"
        return (f"note: pycode from torch {torch_version} (content hash {meta.get('content_sha256')}) is not {why}: "
                f"runs train on other data than the README's and lab/results'")


def text_files(inputs, pattern=TEXT_GLOB):
    """(path, rel) of the files named in inputs, and of those matching pattern in its folders."""
    found = {}
    for given in inputs:
        p = Path(given).absolute()
        if p.is_dir():
            try:
                matches = [f for f in p.glob(pattern) if f.is_file()]
            except (ValueError, NotImplementedError) as e:  # an empty or absolute pattern
                raise DataError(f"--glob {pattern!r}: {e}") from None
            for f in matches:
                found.setdefault(os.path.realpath(f), (str(f), f.relative_to(p).as_posix()))
        elif p.is_file():
            found.setdefault(os.path.realpath(p), (str(p), p.name))
        elif p.exists():
            raise DataError(f"--input {given}: not a regular file or folder (a device or a pipe): give text files")
        else:
            raise DataError(f"--input {given}: no such file or folder")
    return sorted(found.values())


def fingerprint(dataset, options, sources):
    """A cheap identity of a build, reading no file: options and each source's path, size, mtime."""
    h = hashlib.sha256(json.dumps([FORMAT, dataset, options], sort_keys=True).encode())
    for s in sources:
        h.update(f"{s['path']}\0{s['size']}\0{s['mtime_ns']}\n".encode())
    return h.hexdigest()[:32]


def read_meta(out_dir, name="meta.json"):
    """meta.json of a complete dataset, or None (unreadable, or not JSON)."""
    try:
        with open(os.path.join(out_dir, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _file_docs(sources, val_fraction, records, skipped, by_position=False):
    """Yield (split, bytes, nbytes) per source file, recording its hash. by_position (nanoGPT's
    shakespeare): the first 1 - val_fraction of each file to train, the rest to val."""
    for s in sources:
        data = None
        with contextlib.suppress(OSError):
            data = Path(s["path"]).read_bytes()
        if data is None or b"\0" in data:  # unreadable or binary: listed in meta.json
            skipped.append(s["path"])
            continue
        split = "train/val" if by_position else split_of(s["rel"], val_fraction)
        records.append({"path": s["path"], "rel": s["rel"], "bytes": len(data), "split": split,
                        "sha256": hashlib.sha256(data).hexdigest()})
        if by_position:   # cut at a character: each side holds whole UTF-8 sequences for the BPE
            text = data.decode("utf-8", errors="replace")
            cut = len(text[:int(len(text) * (1 - val_fraction))].encode())
            yield "train", data[:cut], cut
            yield "val", data[cut:], len(data) - cut
        else:
            yield split, data, len(data)


def _owt_docs(val_fraction, workers, records):
    """Yield (split, text, nbytes) per OpenWebText document; returns (generator, document count)."""
    try:
        import datasets
    except ImportError:
        raise DataError("--dataset owt needs Hugging Face datasets: pip install datasets "
                        "(and network access and ~55 GB of disk the first time)") from None
    try:
        ds = datasets.load_dataset(OWT_NAME, num_proc=workers)["train"]
    except Exception as e:  # offline, hub errors, disk full: all end the same way
        raise DataError(f"could not load {OWT_NAME} from Hugging Face ({type(e).__name__}: {e}); "
                        "the first load needs network access and ~55 GB of disk") from None
    parts = ds.train_test_split(test_size=val_fraction, seed=2357, shuffle=True)  # nanoGPT's split

    def docs():
        for split, part in (("train", parts["train"]), ("val", parts["test"])):
            h, nbytes = hashlib.sha256(), 0
            for batch in part.iter(batch_size=1024):
                for text in batch["text"]:
                    data = text.encode()
                    h.update(data)
                    nbytes += len(data)
                    yield split, text, len(data)
            records.append({"path": f"hf:{OWT_NAME}", "rel": f"{OWT_NAME}/{split}", "bytes": nbytes,
                            "split": split, "sha256": h.hexdigest()})
    return docs(), len(ds)


def _download_shakespeare(out_dir):
    path = os.path.join(out_dir, "input.txt")
    if not os.path.exists(path):
        print(f"downloading {SHAKESPEARE_URL}")
        try:
            with urllib.request.urlopen(SHAKESPEARE_URL, timeout=60) as r:
                data = r.read()
        except OSError as e:  # URLError and timeouts are OSErrors
            raise DataError(f"could not download tiny Shakespeare ({e}): it needs network access; "
                            f"or put the file at {path} yourself") from None
        with open(os.path.join(out_dir, TEMPORARIES["input.txt"]), "wb") as f:
            f.write(data)
        os.replace(f.name, path)
    return path


def _write_tokens(f, tokens):
    f.write(memoryview(tokens))


def _tokenize(docs, files, enc, workers, total_docs=None):
    """Encode documents in parallel batches, appending tokens and end-of-text to their split."""
    def take(limit):
        """The next documents, about `limit` bytes of text (at least one unless exhausted)."""
        batch, n = [], 0
        for doc in docs:
            batch.append(doc)
            n += doc[2]
            if n >= limit:
                break
        return batch

    counts, ndocs = dict.fromkeys(SPLITS, 0), dict.fromkeys(SPLITS, 0)
    eot, nbytes, t0 = [enc.eot_token], 0, time.time()
    last = t0
    with ThreadPoolExecutor(1) as reader:  # reads and hashes the next batch while this one encodes
        pending = reader.submit(take, CHUNK_BYTES)
        while batch := pending.result():
            pending = reader.submit(take, CHUNK_BYTES)
            encoded = enc.encode_batch([text for _, text, _ in batch], workers)
            for split in SPLITS:
                parts = [p for (s, _, _), toks in zip(batch, encoded) if s == split for p in (toks, eot)]
                _write_tokens(files[split], np.concatenate([np.asarray(p, np.uint16) for p in parts] or [[]]))
                counts[split] += sum(map(len, parts))
                ndocs[split] += len(parts) // 2
            nbytes += sum(b for _, _, b in batch)
            if time.time() - last > PROGRESS_SECONDS:
                last, done, total = time.time(), sum(ndocs.values()), sum(counts.values())
                print(f"  {done:,}/{total_docs:,} docs | {nbytes / 1e6:,.1f} MB | {total / 1e6:,.1f}M "
                      f"tokens | {total / (last - t0) / 1e6:.2f}M tokens/s", file=sys.stderr, flush=True)
    return counts, ndocs


def _publish(out_dir, tmp, meta):
    """Move the finished temporaries into place. meta.json goes first out and last in, so no
    meta.json claims the folder complete while the .bin files are swapped."""
    head = json.dumps({k: v for k, v in meta.items() if k != "sources"}, indent=2)
    sources = ",\n".join("    " + json.dumps(s) for s in meta["sources"])
    with open(tmp["meta.json"], "w") as f:   # indented, a line per source: thousands of them stay readable
        f.write(f'{head[:-2]},\n  "sources": [\n{sources}\n  ]\n}}\n')
        f.flush()
        os.fsync(f.fileno())
    # under REPLACING the folder still says it is this script's: check_not_other_data lets the next build repair it
    with contextlib.suppress(FileNotFoundError):
        os.replace(os.path.join(out_dir, "meta.json"), os.path.join(out_dir, REPLACING))
    for split in SPLITS:
        os.replace(tmp[f"{split}.bin"], os.path.join(out_dir, f"{split}.bin"))
    os.replace(tmp["meta.json"], os.path.join(out_dir, "meta.json"))
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(out_dir, REPLACING))
    with contextlib.suppress(OSError):  # make the renames durable; Windows cannot open a folder
        fd = os.open(out_dir, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)


@contextlib.contextmanager
def _lock(out_dir):
    """One build per folder at a time; the rest (say other ranks of a multi-GPU run) wait. However it ends
    (SIGTERM as Ctrl-C), its temporaries and lock file go: a stopped first run leaves the folder as it was."""
    path, previous = os.path.join(out_dir, LOCK), None
    while True:   # a waiter whose lock file was removed by its holder locks the new one
        f = open(path, "w")
        if fcntl:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"{out_dir}: waiting for another prepare_data run to finish", file=sys.stderr, flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)
        with contextlib.suppress(OSError):
            if not fcntl or os.path.samestat(os.fstat(f.fileno()), os.stat(path)):
                break
        f.close()
    with contextlib.suppress(ValueError):   # not the main thread: signals are not ours to take
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # via the clean-up
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for name in (*TEMPORARIES.values(), LOCK):    # the lock file last, while it is still held
            with contextlib.suppress(OSError):
                os.remove(os.path.join(out_dir, name))
        f.close()


def foreign_files(out_dir, dataset):
    """What in out_dir is not a stopped build's of dataset (its lock and temporaries, shakespeare's
    download; with REPLACING, everything: a build of ours stopped while publishing), sorted."""
    names = sorted(os.listdir(out_dir)) if os.path.isdir(out_dir) else []
    own = {LOCK, *TEMPORARIES.values(), *(["input.txt"] if dataset == "shakespeare" else [])}
    return [] if REPLACING in names else [n for n in names if n not in own]


def prepare(dataset="pycode", out_dir=None, inputs=None, val_fraction=None, workers=None, force=False,
            glob=TEXT_GLOB, tokenizer="gpt2"):
    """Build (or find up to date) the tokenized dataset; returns its folder. val_fraction None:
    the dataset's default (VAL_FRACTION); out_dir None: default_out_dir(dataset, tokenizer)."""
    val_fraction = VAL_FRACTION.get(dataset, 0) if val_fraction is None else val_fraction
    for refused, why in (   # the first that applies is said
            (dataset not in DATASETS, f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}"),
            (tokenizer not in TOKENIZERS, f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}"),
            (not 0 < val_fraction < 1, f"--val-fraction must be between 0 and 1 (exclusive), got {val_fraction}"),
            (dataset == "text" and not inputs, "--dataset text needs --input PATH [PATH ...]"),
            (dataset != "text" and inputs, f"--input is only used with --dataset text, not {dataset}"),
            ((workers or 0) < 0, f"--workers {workers}: give 0 (all cores) or a positive number of threads")):
        if refused:
            raise DataError(why)
    workers = max(1, workers or os.cpu_count() or 1)
    out_dir = out_dir or default_out_dir(dataset, tokenizer)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise DataError(f"{out_dir} is a file: give a folder for the dataset (new, or one this script wrote)")
    check_not_other_data(out_dir, dataset, force)
    try:
        os.makedirs(out_dir, exist_ok=True)
        with _lock(out_dir):
            return _build(dataset, out_dir, inputs, val_fraction, workers, force, glob, tokenizer)
    except OSError as e:
        if e.errno not in UNWRITABLE:
            raise
        raise DataError(f"cannot write the dataset into {out_dir}: {e.strerror}: free space there, or give a "
                        f"writable folder") from None


def check_not_other_data(out_dir, dataset, force=False):
    """A folder that holds data this build would not remake is left alone: train.bin or val.bin without a
    meta.json (nobody knows what they hold), or another dataset (--force replaces it)."""
    held = [n for n in (*(f"{s}.bin" for s in SPLITS), "meta.json") if os.path.exists(os.path.join(out_dir, n))]
    meta = read_meta(out_dir) or read_meta(out_dir, REPLACING)   # REPLACING: a build of ours crashed
    if held and meta is None:
        raise DataError(f"{out_dir} holds {', '.join(held)} but no readable meta.json, so it is left alone: move "
                        f"them away (or rebuild them, e.g. `python prepare_data.py --dataset text --input YOUR_FILES "
                        f"--out-dir {out_dir}`), or give another folder")
    if meta is not None and meta.get("dataset") != dataset and not force:
        raise DataError(f"{out_dir} holds the {meta.get('dataset')} dataset, not {dataset}: give another --out-dir "
                        f"(or --force to replace it)")


def _build(dataset, out_dir, inputs, val_fraction, workers, force, glob, tokenizer):
    t0 = time.time()
    options = {"val_fraction": val_fraction, "tokenizer": tokenizer}
    if dataset == "pycode":
        found = pycode_files()
    elif dataset == "text":
        options["glob"] = glob
        found = text_files(inputs, glob)
    elif dataset == "shakespeare":
        found = [(_download_shakespeare(out_dir), "input.txt")]
    else:
        found = []  # owt: the options alone identify it, so the up-to-date check needs no network
    sources = []
    for path, rel in found:
        with contextlib.suppress(OSError):  # a broken link or no permission: not a source
            st = os.stat(path)
            sources.append({"path": path, "rel": rel, "size": st.st_size, "mtime_ns": st.st_mtime_ns})
    if dataset != "owt" and not sources:
        raise DataError(f"no source files for {dataset}" + (f" (inputs {inputs}, glob {glob})" if inputs else ""))
    fp = fingerprint(dataset, options, sources)
    old, bins = read_meta(out_dir), {split: os.path.join(out_dir, f"{split}.bin") for split in SPLITS}
    if not force and old and old.get("fingerprint") == fp and all(   # and the .bin files hold what it counts
            os.path.isfile(p) and os.path.getsize(p) == old["tokens"][s] * np.dtype(old["dtype"]).itemsize
            for s, p in bins.items()):
        print(f"{out_dir}: up to date ({old['tokens']['train']:,} train / {old['tokens']['val']:,} val tokens); "
              "--force rebuilds")
        return out_dir

    enc = get_tokenizer(tokenizer)
    records, skipped = [], []
    if dataset == "owt":
        docs, total_docs = _owt_docs(val_fraction, workers, records)
    else:
        docs, total_docs = _file_docs(sources, val_fraction, records, skipped, dataset == "shakespeare"), None
    print(f"tokenizing {dataset} ({len(sources) or total_docs:,} sources, {tokenizer} tokenizer) into {out_dir}"
          + (f" with {workers} threads" if tokenizer == "gpt2" else ""))
    tmp = {name: os.path.join(out_dir, temporary) for name, temporary in TEMPORARIES.items()}
    with contextlib.ExitStack() as stack:   # _lock removes the temporaries however the build ends
        files = {s: stack.enter_context(open(tmp[f"{s}.bin"], "wb")) for s in SPLITS}
        counts, ndocs = _tokenize(docs, files, enc, workers, total_docs or len(sources))
        for f in files.values():
            f.flush()
            os.fsync(f.fileno())
    if not sum(ndocs.values()):
        raise DataError(f"no readable text in the sources of {dataset} (skipped: {len(skipped)})")
    content = hashlib.sha256("".join(f"{r['sha256']} {r['split']} {r['rel']}\n" for r in records).encode())
    seconds = max(time.time() - t0, 1e-6)  # coarse clocks (Windows) can give 0
    meta = {
        "dataset": dataset, "options": options, "tokens": counts, "documents": ndocs,
        "tokenizer": tokenizer, "vocab_size": enc.n_vocab, "eot_token": enc.eot_token, "dtype": "uint16",
        "fingerprint": fp,  # of paths, sizes, mtimes and options: the up-to-date check
        "content_sha256": content.hexdigest(),  # of the sources' "<sha256> <split> <rel>" lines
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "seconds": round(seconds, 2),
        "versions": {"format": FORMAT, "python": platform.python_version(), "numpy": np.__version__,
                     "tiktoken": version("tiktoken"), **({"torch": version("torch")} if dataset == "pycode" else {})},
        "skipped": skipped, "sources": records,
    }
    _publish(out_dir, tmp, meta)
    total = sum(counts.values())
    print(f"{dataset} -> {out_dir}: train {counts['train']:,} tokens ({ndocs['train']:,} docs) | val "
          f"{counts['val']:,} tokens ({ndocs['val']:,} docs) | {seconds:.1f} s, {total / seconds / 1e6:.2f}M tokens/s")
    for split in [s for s in SPLITS if not ndocs[s]]:
        print(f"warning: the {split} split is empty; use more files or another --val-fraction", file=sys.stderr)
    if dataset == "pycode" and (note := check_pycode_identity(meta)):
        print(note, file=sys.stderr)
    return out_dir


# -----------------------------------------------------------------------------
# The read side of the format, for train.py: checked against meta.json, sampled reproducibly.

class TokenWindows:
    """Random windows of block_size + 1 tokens. Step s's windows depend only on (seed, s): a resumed
    run sees the batches an uninterrupted one would, runs with one seed see one data order, and N
    processes together see the same global batch as one."""

    def __init__(self, data_dir, block_size, batch_size, seed, dataset="pycode", tokenizer="gpt2"):
        meta_path = os.path.join(data_dir, "meta.json")
        redo = (f"re-run `python prepare_data.py --dataset {dataset} --tokenizer {tokenizer} --out-dir {data_dir} "
                f"--force`")
        meta = read_meta(data_dir)
        if not isinstance(meta, dict):   # unreadable, not JSON, or not an object; nothing is deleted: the user decides
            raise SystemExit(f"error: cannot read {meta_path} as a dataset description: {redo}")
        self.tokenizer = meta.get("tokenizer")           # what the model is sized for, and every lookup
        if (self.tokenizer, meta.get("vocab_size")) not in [*VOCAB_SIZES.items()]:
            raise SystemExit(f"error: {meta_path} names no known tokenizer and vocabulary (tokenizer "
                             f"{self.tokenizer!r}, vocab_size {meta.get('vocab_size')!r}; known {VOCAB_SIZES}): {redo}")
        self.vocab_size, self.data = VOCAB_SIZES[self.tokenizer], {}
        for split in SPLITS:
            path = os.path.join(data_dir, f"{split}.bin")
            if not os.path.exists(path):
                raise SystemExit(f"error: {path} is missing although {meta_path} exists: {redo}")
            size = os.path.getsize(path)
            expected = meta.get("tokens", {}).get(split)
            if size % 2 or (expected is not None and size // 2 != expected):
                raise SystemExit(f"error: {path} holds {size} bytes, not the {expected} uint16 tokens meta.json "
                                 f"records: the file is damaged; {redo}")
            if size // 2 <= block_size + 1:
                raise SystemExit(f"error: {path} holds {size // 2} tokens, too few for --block-size {block_size}")
            self.data[split] = np.memmap(path, dtype=np.uint16, mode="r")
            largest = int(self.data[split].max())   # ~0.1 s per 100M tokens
            if largest >= self.vocab_size:
                raise SystemExit(f"error: {path} holds token {largest}, outside the {self.tokenizer} vocabulary of "
                                 f"{self.vocab_size} that {meta_path} gives: the file is not of this dataset; {redo}")
        self.block_size, self.batch_size, self.seed = block_size, batch_size, seed
        # what a run records of the data it trained on (config.json, log.jsonl's start record)
        self.identity = {"dataset": meta.get("dataset"), "tokenizer": self.tokenizer,
                         "content_sha256": meta.get("content_sha256"), "train_tokens": len(self.data["train"]),
                         "val_tokens": len(self.data["val"]), "torch": meta.get("versions", {}).get("torch")}

    def get(self, split, step, index):
        """Window `index` of step `step` (val: eval batch `index`, the same at every eval), int64 (B, T + 1)."""
        data, T = self.data[split], self.block_size
        rng = np.random.default_rng([self.seed, 0 if split == "train" else 1, step, index])
        starts = rng.integers(0, len(data) - T - 1, size=self.batch_size)
        return np.stack([data[s:s + T + 1] for s in starts]).astype(np.int64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", choices=DATASETS, default="pycode", help="default pycode (above)")
    parser.add_argument("--tokenizer", choices=TOKENIZERS, default="gpt2", help="default gpt2 (above)")
    parser.add_argument("--out-dir", help="output folder (default data/<dataset>[-byte] next to this script)")
    parser.add_argument("--input", nargs="+", metavar="PATH", dest="inputs", help="text: files and folders")
    parser.add_argument("--glob", default=TEXT_GLOB, help=f"text: files to take from --input folders (default "
                        f"{TEXT_GLOB}); ** recurses; files with NUL bytes are skipped as binary")
    parser.add_argument("--val-fraction", type=float, help="share of files (for shakespeare, of text) that goes "
                        "to val; default " + ", ".join(f"{k} {v}" for k, v in VAL_FRACTION.items()))
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="tokenizer threads (0: one per core)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    args = parser.parse_args(argv)
    try:
        prepare(**vars(args))
    except DataError as e:
        parser.error(str(e.code))
    except KeyboardInterrupt:   # the build removed what it had begun (_lock)
        sys.exit("stopped: nothing half-made is left; run the command again to build the dataset")


if __name__ == "__main__":
    main()
