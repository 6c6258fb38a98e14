"""Checking at scale: the checker beside the backend's own replay on decode traces, loading a
trace file, reading back a range of a long sequence, the NumPy quantizer's steps without its
compiled kernels (the floor the kernels are measured from), a gather into a reused buffer beside
np.copyto, and the fixed cost of an alloc+free."""
import os
import tempfile

import numpy as np

from . import common
from .common import GATHER_TOKENS, QUANT_SCHEMES, SCALE_DECODE_REQUESTS, SCALE_GATHER_TOKENS


class CheckDecode:
    """A decode trace checked (K/V written and read back, touched mode), and the same trace
    replayed by the backend alone: their ratio is the checker's cost per operation."""
    version = "1"
    params = [SCALE_DECODE_REQUESTS]
    param_names = ["requests"]
    number = 1
    repeat = (1, 5, 30.0)
    timeout = 600

    def setup(self, requests):
        try:
            try:
                from kvbench.analyses import suite
            except ImportError:  # a commit from before the suite sat above the analyses
                from kvbench.checking import suite
            from kvbench.checking.checker import check
        except ImportError as e:
            raise NotImplementedError(str(e)) from None
        self.check = check
        self.trace = common.decode_trace(requests)
        self.config = suite.config_for(self.trace)
        self.kv = common.kv_buffer(self.trace, self.config)

    def _backend(self):
        return common.registry.create("numpy", self.config)

    def time_check(self, requests):
        self.check(self.trace, self._backend())

    def time_replay(self, requests):
        common.replay(self._backend(), self.trace, self.kv)

    def peakmem_check(self, requests):
        self.check(self.trace, self._backend())


class LoadTrace:
    """Loading a decode trace file (~8,000 operations, JSONL): parse and validate."""
    version = "1"
    number = 1
    repeat = (3, 10, 20.0)
    timeout = 300

    def setup_cache(self):
        from kvbench.api import save
        path = os.path.join(tempfile.mkdtemp(prefix="kvbench-asv-"), "decode.jsonl")
        save(common.decode_trace(SCALE_DECODE_REQUESTS[-1]), path)
        return path

    def time_load(self, path):
        common.load(path)

    def peakmem_load(self, path):
        common.load(path)

    def track_bytes_per_operation(self, path):
        ops = common.load(path).ops
        if not hasattr(ops, "nbytes"):
            raise NotImplementedError("traces load as op objects at this commit")
        return ops.nbytes / len(ops)
    track_bytes_per_operation.unit = "bytes"


class GatherRange:
    """One block read back from a 4096-token sequence (the checker's read after a decode step):
    a backend that gathers whole sequences pays for all 4096 tokens."""
    version = "1"
    params = [["numpy"]]
    param_names = ["backend"]

    def setup(self, name):
        try:
            from kvbench.contract.protocol import read_kv
        except ImportError:
            if common.Prompt is None:
                raise NotImplementedError("no gather ranges at this commit") from None
            read_kv = _ranged_gather  # since the Prompt every gather takes a range
        self.read_kv = read_kv
        self.backend = common.interleaved_pair(name, SCALE_GATHER_TOKENS)

    def teardown(self, name):
        common.close(self)

    def time_gather_block(self, name):
        self.read_kv(self.backend, 0, SCALE_GATHER_TOKENS - common.BLOCK_SIZE, SCALE_GATHER_TOKENS)


def _ranged_gather(backend, seq, start, stop):
    return np.asarray(backend.gather(seq, start, stop))


class QuantizeSteps:
    """The NumPy quantizer without its compiled kernels (compiled=False), on the suite's 4 MiB
    sample: bench_quant.Quantize times it with them where numba is installed."""
    version = "1"
    params = [list(QUANT_SCHEMES)]
    param_names = ["scheme"]

    def setup(self, scheme):
        impl = common.quantizer("numpy")
        import inspect
        if "compiled" not in inspect.signature(impl.quantize).parameters:
            raise NotImplementedError("no compiled kernels at this commit")
        self.impl, self.scheme, self.x = impl, common.quant_scheme(scheme), common.kv_sample()

    def time_quantize_steps(self, scheme):
        self.impl.quantize(self.x, self.scheme, compiled=False)


class GatherInto:
    """Gather of one sequence's K/V (``tokens`` tokens, 1 KiB each, scattered blocks) into a
    buffer the caller reuses from call to call: CopyToSameBytes is its floor (the ratio gate
    gather_into_vs_copyto holds the two at 4096 tokens)."""
    version = "1"
    params = [["numpy"], GATHER_TOKENS]
    param_names = ["backend", "tokens"]

    def setup(self, name, tokens):
        import inspect
        self.backend = common.interleaved_pair(name, tokens)
        if "out" not in inspect.signature(self.backend.gather).parameters:
            raise NotImplementedError("gather takes no out= at this commit")
        self.out = np.empty_like(common.zeros_kv(tokens))

    def teardown(self, name, tokens):
        common.close(self)

    def time_gather_into(self, name, tokens):
        self.backend.gather(0, out=self.out)


class CopyToSameBytes:
    """The floor for GatherInto: np.copyto of the same bytes into a buffer reused across calls."""
    version = "1"
    params = [GATHER_TOKENS]
    param_names = ["tokens"]

    def setup(self, tokens):
        self.src = common.zeros_kv(tokens) + np.float16(1)
        self.dst = np.empty_like(self.src)

    def time_copyto(self, tokens):
        np.copyto(self.dst, self.src)


class AllocFree:
    """A prefill of ``blocks`` full blocks then its free, ledger only, on an empty pool: the
    fixed cost of a call (benchmarks/test_bench_vllm.py sets it beside vLLM's BlockPool)."""
    version = "1"
    params = [["numpy", "object"], [1, 256]]
    param_names = ["backend", "blocks"]

    def setup(self, name, blocks):
        self.backend = common.make_backend(name, num_blocks=1024, store_kv=False)
        tokens = blocks * common.BLOCK_SIZE
        self.prompt, self.keywords = common.prompt_call(tokens, final_tokens=tokens)

    def teardown(self, name, blocks):
        common.close(self)

    def time_alloc_free(self, name, blocks):
        self.backend.prefill(0, self.prompt, None, **self.keywords)
        self.backend.free(0)
