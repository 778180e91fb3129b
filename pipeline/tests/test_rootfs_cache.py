"""The rootfs cache's pruning: a layer used lately survives other checkouts' captures."""

from __future__ import annotations

import os
import time
from pathlib import Path

from readie_pipeline import rootfs
from readie_pipeline.rootfs import KEEP_OLD_LAYERS, LAYER_IN_USE_S, MAX_OLD_LAYERS


def _layer(layers: Path, name: str, age_s: float) -> Path:
    layer = layers / name
    layer.mkdir(parents=True)
    when = time.time() - age_s
    os.utime(layer, (when, when))
    return layer


def test_layers_used_lately_are_kept_and_stale_ones_pruned(tmp_path: Path) -> None:
    current = _layer(tmp_path, "current", 0)
    # Two checkouts' layers from this afternoon, and old ones nobody captured with for days.
    recent = [_layer(tmp_path, f"recent{i}", 60 * (i + 1)) for i in range(KEEP_OLD_LAYERS + 2)]
    stale = [_layer(tmp_path, f"stale{i}", LAYER_IN_USE_S + 3600 * (i + 1)) for i in range(3)]
    imported = _layer(tmp_path, f"{rootfs.IMPORTED_LAYER_PREFIX}set", LAYER_IN_USE_S * 10)

    rootfs._prune(tmp_path, keep=current)

    assert current.exists() and imported.exists()
    assert all(layer.exists() for layer in recent)  # more than KEEP_OLD_LAYERS, but in use
    assert not any(layer.exists() for layer in stale)


def test_the_cache_stays_bounded_however_recent(tmp_path: Path) -> None:
    current = _layer(tmp_path, "current", 0)
    layers = [_layer(tmp_path, f"layer{i:02}", i + 1) for i in range(MAX_OLD_LAYERS + 3)]

    rootfs._prune(tmp_path, keep=current)

    kept = [layer for layer in layers if layer.exists()]
    assert kept == layers[:MAX_OLD_LAYERS]  # the newest, up to the bound
