"""The peak resident set scripts/scaling.py reports is the measured process's own: a child started
by a large parent (fork, then exec) reads the parent's resident set as its ``ru_maxrss``."""
import json
import subprocess
import sys

import numpy as np

from kvbench.provenance import peak_rss_mb

CHILD = "import json; from kvbench.provenance import peak_rss_mb; print(json.dumps(peak_rss_mb()))"


def test_peak_rss_counts_this_process_and_not_its_parent():
    held = np.ones(2**25)  # 256 MiB = 2**25 * 8 bytes, every page written
    assert peak_rss_mb() >= 256
    child = json.loads(subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                                      check=True).stdout)
    assert held[-1] == 1  # still held while the child ran
    assert child < 200, child  # an interpreter with numpy imported: tens of MiB, not the parent's 256+
