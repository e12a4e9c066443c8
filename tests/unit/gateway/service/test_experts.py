"""gateway/service/experts.py: summing the workers' expert counts and writing SGLang's CSV."""

from __future__ import annotations

from pathlib import Path

from gateway.service.experts import CSV_HEADER, summed_counts, write_csv
from gateway.cluster.worker_records import ExpertCounts


def _reply(layer_ids: list[int], counts: list[int]) -> ExpertCounts:
    return ExpertCounts(layer_ids=tuple(layer_ids), num_experts=3, counts=tuple(counts), num_experts_per_tok=2)


def test_counts_are_summed_per_layer_and_expert_over_every_worker() -> None:
    prefill = _reply([0, 2], [4, 0, 2, 1, 1, 0])
    decode = _reply([0, 2], [0, 1, 1, 3, 0, 5])
    assert summed_counts([prefill, decode]) == {(0, 0): 4, (0, 1): 1, (0, 2): 3, (2, 0): 4, (2, 1): 1, (2, 2): 5}
    assert summed_counts([]) == {}


def test_csv_has_sglangs_header_and_one_row_per_layer_and_expert(tmp_path: Path) -> None:
    counts = {(0, 0): 4, (0, 1): 0, (2, 0): 7, (2, 1): 1}
    first = write_csv(tmp_path / "new_dir", counts)
    second = write_csv(tmp_path / "new_dir", counts)
    assert first != second   # never overwrites
    assert first.name.startswith("expert_distribution_") and first.suffix == ".csv"
    lines = first.read_text().splitlines()
    assert lines[0] == CSV_HEADER == "layer_id,expert_id,count"
    assert lines[1:] == ["0,0,4", "0,1,0", "2,0,7", "2,1,1"]
