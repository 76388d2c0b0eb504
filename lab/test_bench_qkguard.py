"""lab/bench_qkguard.py: the cost table's grid runs and prints one row per size, batch and interval (tiny, 1 step)."""
import re

from lab import bench_qkguard


def test_the_cost_table_has_a_row_per_cell_with_an_aa_column(capsys):
    bench_qkguard.main(["--model", "nanogpt", "--sizes", "small", "--batches", "2x8", "--intervals", "1", "2",
                        "--steps", "1"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| small")]
    assert len(rows) == 2
    for row, interval in zip(rows, ("1", "2")):
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "2x8" and cells[4] == interval
        assert all(re.fullmatch(r"[+-]\d+\.\d%", c) for c in (cells[3], cells[5], cells[6])), row
