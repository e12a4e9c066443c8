"""UpdateWeights' path check: only paths under a weights directory, and none with a `..` component."""

from __future__ import annotations

from pathlib import Path

from server_runtime.common_rpcs import is_within


def test_a_path_is_within_its_directory_only(tmp_path: Path) -> None:
    weights = tmp_path / "weights"
    (weights / "model").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (weights / "link").symlink_to(tmp_path / "outside")
    assert is_within(str(weights / "model"), str(weights)) and is_within(str(weights), str(weights))
    assert not is_within(str(tmp_path / "outside"), str(weights))
    assert not is_within(str(weights / "link"), str(weights))   # links are resolved first
    assert not is_within(str(tmp_path / "weightsX"), str(weights))


def test_a_path_with_dot_dot_is_never_within(tmp_path: Path) -> None:
    """Where `..` lands depends on links outside the directory; answering it would reveal them."""
    weights = tmp_path / "weights"
    (weights / "model").mkdir(parents=True)
    for path in (f"/nonexistent/..{weights}/model", f"{weights}/../weights/model", f"{weights}/model/..",
                 f"/bin/..{weights}/model"):
        assert not is_within(path, str(weights)), path
