"""
Files written whole, and together: each to <path>.tmp, all renamed into place only once every one was written
(written_together); a failure, or a refusal, before then leaves every file as it was.
"""
import contextlib
import os


STAGED = None   # inside written_together(): [(temp file, its path)]


@contextlib.contextmanager
def written_together():
    global STAGED
    STAGED = []
    try:
        yield
        for tmp, path in STAGED:
            os.replace(tmp, path)
    finally:
        for tmp, _ in STAGED:   # those not renamed: an error came first
            with contextlib.suppress(OSError):
                os.remove(tmp)
        STAGED = None


def _place(tmp, path):
    if STAGED is None:
        os.replace(tmp, path)
    else:
        STAGED.append((tmp, path))


def save_figure(fig, png, **kw):
    """fig as a PNG at png, whole: a temp file renamed at once, or with the rest (written_together)."""
    fig.savefig(png + ".tmp", format="png", **kw)
    _place(png + ".tmp", png)


def save_text(path, text):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    _place(path + ".tmp", path)
