"""
The two tokenizers: documents (bytes) to tokens, for prepare_data.py, and tokens back to text, for
sample.py. gpt2: GPT-2's BPE, the paper's (50,257 tokens); byte: a token per byte plus end-of-text
(257 tokens), which makes a CPU lab fast (lab/MEASUREMENTS.md). A dataset's meta.json names its own.
"""
import numpy as np
import tiktoken

TOKENIZERS = ("gpt2", "byte")
VOCAB_SIZES = {"gpt2": 50257, "byte": 257}   # each tokenizer's n_vocab (GPT-2's without its file)
GPT2_ENCODING = "r50k_base"   # GPT-2's BPE; get_encoding("gpt2") needs 2 more files: fails offline


class DataError(SystemExit):
    """Bad input or a missing requirement, a SystemExit: it ends the program with no traceback."""


class ByteTokenizer:
    """A token per byte (0..255) and end-of-text, 256: every file comes back byte for byte, UTF-8
    or not. (A file holding a NUL byte is skipped as binary, so nothing else could be confused.)"""
    n_vocab, eot_token = 257, 256

    def encode_batch(self, docs, workers=1): return [np.frombuffer(d, np.uint8) for d in docs]
    def encode(self, text): return list(text.encode())
    def decode_bytes(self, tokens): return bytes(t for t in tokens if t < 256)   # EOT, padding: no
    def decode(self, tokens): return self.decode_bytes(tokens).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2's BPE through tiktoken. Undecodable bytes become U+FFFD rather than losing the file,
    and "<|endoftext|>" inside a document is plain text, not the special token."""

    def __init__(self):
        try:
            self.enc = tiktoken.get_encoding(GPT2_ENCODING)
        except (OSError, ValueError) as e:   # offline (requests' errors are OSErrors), a bad file
            raise DataError(f"GPT-2's BPE is not in tiktoken's cache and could not be downloaded "
                            f"({type(e).__name__}): point TIKTOKEN_CACHE_DIR at a folder holding "
                            f"its ranks file (README), or use --tokenizer byte") from None
        self.n_vocab, self.eot_token = self.enc.n_vocab, self.enc.eot_token

    def encode_batch(self, docs, workers=1):
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        return self.enc.encode_ordinary_batch(texts, num_threads=workers)

    def encode(self, text): return self.enc.encode(text, allowed_special={"<|endoftext|>"})
    def decode(self, tokens): return self.enc.decode([t for t in tokens if t < self.n_vocab])


def get_tokenizer(name):
    """The tokenizer a meta.json names."""
    if name not in TOKENIZERS:
        raise DataError(f"unknown tokenizer {name!r}: choose one of {', '.join(TOKENIZERS)}")
    return ByteTokenizer() if name == "byte" else GPT2Tokenizer()
