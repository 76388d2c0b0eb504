"""lab.kernel_fingerprint: the same kernel gives the same lines; one changed rounding changes its case's line."""
import pytest

from lab import kernel_fingerprint as kf

ONLY = "torch bf16 bf16 qk_norm softcap"   # one case, quick: the PyTorch twin with bf16 state


def fingerprint(capsys):
    kf.main(["--only", ONLY])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].endswith(ONLY) and lines[1].endswith("OVERALL")
    return lines


def test_the_same_kernel_gives_the_same_fingerprint_and_a_changed_one_another(capsys, monkeypatch):
    first = fingerprint(capsys)
    assert fingerprint(capsys) == first
    monkeypatch.setattr(kf.ak, "_rms_norm", lambda x, eps=1e-5: x * (x.float().pow(2).mean(-1, keepdim=True)
                                                                     + eps).rsqrt().to(x.dtype))
    assert fingerprint(capsys)[0] != first[0]


def test_a_tree_without_the_kernel_is_refused_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        kf.main(["--tree", str(tmp_path)])
    assert "no attention_kernel.py there" in capsys.readouterr().err
