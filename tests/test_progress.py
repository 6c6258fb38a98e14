"""The one progress reporter (kvbench.progress): plain lines in a log, a bar on a terminal."""
import io

from kvbench.progress import Progress


def test_a_line_in_a_log_carries_the_count_the_share_the_eta_and_the_note():
    out = io.StringIO()
    p = Progress(8, "replaying", "runs", stream=out, every=0.0, done=2)
    p.note("1 FAIL")
    p.update(2)
    line = out.getvalue().splitlines()[-1]
    assert line.startswith("replaying: 4/8 runs (") and "\r" not in out.getvalue()
    assert "50%" in line and "ETA" in line and line.endswith(", 1 FAIL)")  # 50% = 4 / 8


def test_a_count_without_a_total_has_no_share_and_no_eta():
    out = io.StringIO()
    p = Progress(None, "fuzz", "histories", stream=out, every=0.0)
    p.update(3)
    line = out.getvalue().strip()
    assert line.startswith("fuzz: 3 histories (") and "%" not in line and "ETA" not in line


def test_disabled_it_prints_nothing_even_what_it_is_told_to_say():
    out = io.StringIO()
    p = Progress(4, "x", stream=out, every=0.0, enabled=False)
    p.update(4)
    p.say("found one")
    p.close()
    assert out.getvalue() == ""


def test_on_a_terminal_it_is_a_bar_that_counts_from_the_work_done_before():
    out = io.StringIO()
    p = Progress(10, "s", "cells", stream=out, tty=True, done=3)
    p.update(2)
    p.close()
    assert p.bar is not None and p.bar.n == 5 and "\r" in out.getvalue()  # 5 = 3 before + 2
