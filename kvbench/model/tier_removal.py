"""Tier rule ``failed_read_removes_at_once`` (vLLM 0.33's file tier), beside the tier model of
tiers.py: a failed load removes each entry it read in a tier whose ``failed_load`` is "drop" at
its completion, whoever else reads it, where SPEC §11 keeps such an entry until no load reads it.

vLLM's ``FileSystemTierManager`` counts no readers: the short read that fails a load removes the
block's file in its I/O thread (``tiering/fs/io.py`` ``_load_block``, ``os.remove`` at :161).
A load of the same block that reads it after that opens no file (``os.open`` at :156 raises
``FileNotFoundError``), so its job fails and its keys are marked a miss (``fs/manager.py``:299-316):
the block is computed again. The model: the entry leaves its tier at once (not loadable, not
stored, not loading); each other load in flight that read it reads none of it (``Transfer.lost``:
at its completion, ok or not, nothing of it moves up, and its device block is computed again);
each lookup's pin on it is released with nothing to release.
"""
from __future__ import annotations


def remove_at_once(tiers, failed) -> None:
    """``failed``: a load just completed failed (no longer among ``tiers.transfers``). Each
    entry it read in a "drop" tier leaves at once, lost to every load that read it."""
    others = [tr for tr in tiers.transfers.values() if tr.kind == "load"]
    for key, tier, _ in failed.blocks:
        t = tiers.tiers[tier]
        if t.spec.failed_load != "drop" or (key, tier) in failed.lost:
            continue
        for tr in others:
            if any((k, i) == (key, tier) for k, i, _ in tr.blocks):
                tr.lost.add((key, tier))
        for tr in (failed, *others):
            tr.pins = [pin for pin in tr.pins if pin != (key, tier)]
        for seq, pins in tiers.pins.items():
            tiers.pins[seq] = [pin for pin in pins if pin != (key, tier)]
        failed.lost.add((key, tier))
        t.loading -= bool(t.entries[key].loads)
        tiers._drop(t, key)


__all__ = ["remove_at_once"]
