"""A Hugging Face Hub cache on disk with one model repo in it, laid out as ``huggingface_hub`` writes
one (``models--<org>--<name>/refs/main`` naming a commit, ``snapshots/<commit>/`` holding the files),
so that ``snapshot_download`` resolves it with ``HF_HUB_OFFLINE=1`` and no network."""

from __future__ import annotations

import hashlib
from pathlib import Path


def make_cached_repo(hub_cache: Path, repo_id: str, checkpoint: Path) -> Path:
    """Put ``checkpoint``'s files (linked) into ``hub_cache`` as ``repo_id`` at revision main;
    returns the snapshot directory."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    repo = hub_cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for file in checkpoint.iterdir():
        if file.is_file():
            (snapshot / file.name).symlink_to(file.resolve())
    return snapshot
