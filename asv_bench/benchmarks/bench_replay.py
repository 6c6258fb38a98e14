"""Whole committed traces replayed straight through a backend (no oracle, no checker), and the
lower-is-better memory figures of each replay, which must never drift (track_)."""
from . import common
from .common import REPLAY_CASES, REPLAYED


class Replay:
    """Time and peak memory of one whole trace, K/V written (zeros: the content is not checked)."""
    version = "1"
    params = [REPLAYED, REPLAY_CASES]
    param_names = ["backend", "workload"]
    number = 1
    repeat = (1, 5, 10.0)
    timeout = 300

    def setup(self, name, case):
        self.backend, self.trace = common.replay_backend(name, case, store_kv=True)
        self.kv = common.kv_buffer(self.trace, self.backend.config)

    def teardown(self, name, case):
        common.close(self)

    def time_replay(self, name, case):
        common.replay(self.backend, self.trace, self.kv)
        common.sync(self.backend)

    def peakmem_replay(self, name, case):
        # The whole process's peak RSS: imports, the trace and the pool.
        common.replay(self.backend, self.trace, self.kv)


class ReplayLedger:
    """The same replay with store_kv=False: the cost of the block bookkeeping alone."""
    version = "1"
    params = [REPLAYED, REPLAY_CASES]
    param_names = ["backend", "workload"]
    number = 1
    repeat = (1, 5, 10.0)
    timeout = 300

    def setup(self, name, case):
        self.backend, self.trace = common.replay_backend(name, case, store_kv=False)

    def teardown(self, name, case):
        common.close(self)

    def time_replay_ledger(self, name, case):
        common.replay(self.backend, self.trace)
        common.sync(self.backend)


def _stats_of_every_case():
    """ledger_stats for every (backend, case) that runs here: one replay each, shared by the
    track_ methods; a combination that cannot run maps to why."""
    stats = {}
    for name in REPLAYED:
        for case in REPLAY_CASES:
            try:
                stats[name, case] = common.case_stats(name, case)
            except NotImplementedError as e:
                stats[name, case] = str(e)
    return stats


class _Figures:
    """The replay figures of every case, computed once (setup_cache) and shared by Waste and
    BlocksInUse: asv keys a setup_cache by where the function is defined."""
    version = "1"
    params = [REPLAYED, REPLAY_CASES]
    param_names = ["backend", "workload"]
    timeout = 600

    def setup_cache(self):
        return _stats_of_every_case()

    def setup(self, stats, name, case):
        got = stats[name, case]
        if isinstance(got, str):
            raise NotImplementedError(got)
        self.stats = got

    def _figure(self, key):
        return self.stats[key]


class Waste(_Figures):
    """Memory the replay wastes, read from the backend's own ledger after every operation.

    Deterministic: any change across commits is a change of the code (kvbench gates checks the
    same figures exactly against committed values).
    """

    def track_peak_bytes(self, stats, name, case):
        return self._figure("peak_bytes")
    track_peak_bytes.unit = "bytes"

    def track_final_fragmentation(self, stats, name, case):
        return self._figure("final_fragmentation")
    track_final_fragmentation.unit = "fraction"

    def track_mean_fragmentation(self, stats, name, case):
        return self._figure("mean_fragmentation")
    track_mean_fragmentation.unit = "fraction"

    def track_mean_wasted_slots(self, stats, name, case):
        return self._figure("mean_wasted_slots")
    track_mean_wasted_slots.unit = "slots"

    def track_peak_wasted_slots(self, stats, name, case):
        return self._figure("peak_wasted_slots")
    track_peak_wasted_slots.unit = "slots"

    def track_recomputed_tokens(self, stats, name, case):
        return self._figure("recomputed_tokens")
    track_recomputed_tokens.unit = "tokens"


class BlocksInUse(_Figures):
    """Peak blocks in use (a contiguous arena has no blocks: n/a there)."""

    def setup(self, stats, name, case):
        super().setup(stats, name, case)
        if self.stats["peak_blocks"] is None:
            raise NotImplementedError(f"{name} has no blocks")

    def track_peak_blocks(self, stats, name, case):
        return self.stats["peak_blocks"]
    track_peak_blocks.unit = "blocks"
