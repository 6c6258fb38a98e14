"""The published asv dashboard shows without the Internet (kvbench/bench/dashboard.py): a tiny
result set published, its page opened by headless Chromium that can reach nothing but the
localhost server, as a user behind a firewall sees it."""
from __future__ import annotations

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvbench.bench import dashboard as D

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = next(filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None)

TINY_SUITE = '''
def time_sum():
    sum(range(1000))


def track_blocks():
    return 42
'''


def git(repo, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                   check=True, capture_output=True)


def asv(repo, *args):
    # HOME: asv keeps its machine file there (~/.asv-machine.json)
    env = {**os.environ, "HOME": str(repo / "home")}
    run = subprocess.run([sys.executable, "-m", "asv", *args], cwd=repo, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, f"asv {' '.join(args)}: {run.stdout[-2000:]}{run.stderr[-2000:]}"


@pytest.fixture(scope="module")
def published(tmp_path_factory) -> Path:
    """A two-commit asv history of two benchmarks, published (html/)."""
    pytest.importorskip("asv")
    repo = tmp_path_factory.mktemp("asv")
    (repo / "home").mkdir()
    (repo / "benchmarks").mkdir()
    (repo / "benchmarks" / "__init__.py").write_text("")
    (repo / "benchmarks" / "bench_tiny.py").write_text(TINY_SUITE)
    (repo / "asv.conf.json").write_text(
        '{"version": 1, "project": "tiny", "repo": ".", "branches": ["main"], '
        '"environment_type": "existing", "benchmark_dir": "benchmarks", '
        '"results_dir": "results", "html_dir": "html"}')
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "one")
    (repo / "f").write_text("x")
    git(repo, "add", "f")
    git(repo, "commit", "-qm", "two")
    commits = subprocess.run(["git", "rev-list", "main"], cwd=repo, capture_output=True,
                             text=True, check=True).stdout.split()
    asv(repo, "machine", "--yes", "--machine", "tiny")
    for commit in commits:  # a series of two points
        asv(repo, "run", "--quick", "-E", "existing:same", "--set-commit-hash", commit,
            "--machine", "tiny")
    asv(repo, "publish")
    return repo / "html"


class Dom(HTMLParser):
    """What the page shows: the benchmark names of the grid, and the ids and classes of the
    elements a flot canvas (a plotted series) was drawn in."""

    VOID = {"img", "br", "input", "meta", "link", "hr", "col", "source", "area", "base", "wbr"}

    def __init__(self, text: str):
        super().__init__()
        self.stack, self.names, self.plotted = [], [], set()
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        marks = {f"#{a['id']}"} if a.get("id") else set()
        marks |= {f".{c}" for c in (a.get("class") or "").split()}
        if tag == "canvas" and ".flot-base" in marks:
            self.plotted |= set().union(*(m for _, m in self.stack))
        if tag not in self.VOID:
            self.stack.append((tag, marks))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if self.stack and ".benchmark-text" in self.stack[-1][1] and data.strip():
            self.names.append(data.strip())


def shown(html_dir: Path, fragment: str, tmp_path: Path) -> Dom:
    """The DOM of html_dir/index.html``fragment`` after its scripts ran, in headless Chromium
    served from localhost, every host name unresolvable (no CDN, no network)."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(html_dir))
    handler.log_message = lambda *a: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        run = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
             f"--user-data-dir={tmp_path / 'chromium'}",
             "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
             "--virtual-time-budget=10000", "--dump-dom",
             f"http://127.0.0.1:{server.server_port}/index.html{fragment}"],
            capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert run.returncode == 0, run.stderr[-2000:]
    return Dom(run.stdout)


@pytest.fixture(scope="module")
def localized(published, tmp_path_factory) -> Path:
    html = tmp_path_factory.mktemp("site") / "html"
    shutil.copytree(published, html)
    try:
        D.localize(html, ROOT / D.CACHE_DIR)  # the cache a publish from the repository keeps
    except D.Unreachable as e:
        pytest.skip(str(e))
    return html


@pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                             "(Debian: apt-get install chromium)")
def test_the_published_dashboard_shows_offline(localized, tmp_path):
    grid = shown(localized, "", tmp_path / "grid")
    assert grid.names == ["time_sum", "track_blocks"]
    assert {"#summarygrid-bench_tiny.time_sum", "#summarygrid-bench_tiny.track_blocks"} <= grid.plotted
    graph = shown(localized, "#bench_tiny.time_sum", tmp_path / "graph")
    assert "#main-graph" in graph.plotted


def test_every_script_and_stylesheet_is_served_from_the_folder(localized):
    page = (localized / "index.html").read_text(encoding="utf-8")
    assert not D.REMOTE.search(page)
    assert "integrity=" not in page  # (a file:// or localhost copy fails a CORS check)
    for package in D.PACKAGES:
        for rel in package.files.values():
            assert (localized / D.VENDOR / package.folder / rel).is_file()
            assert f'"{D.VENDOR}/{package.folder}/{rel}"' in page
    # bootstrap's stylesheet loads its icons from ../fonts/
    assert (localized / D.VENDOR / "bootstrap@3.1.1" / "dist" / "fonts"
            / "glyphicons-halflings-regular.woff").is_file()


def test_a_tarball_that_is_not_the_pinned_one_is_refused(tmp_path):
    jquery = next(p for p in D.PACKAGES if p.name == "jquery")
    (tmp_path / jquery.tarball).write_bytes(b"not jquery")
    with pytest.raises(D.DashboardError, match=r"jquery-3.3.1.tgz: not the pinned jquery@3.3.1"):
        D.tarball(jquery, tmp_path)


def test_an_address_no_package_provides_is_named(tmp_path):
    page = '<script src="https://cdn.example/new-lib.js"></script>'
    (tmp_path / "index.html").write_text(page)
    with pytest.raises(D.DashboardError, match=r"loads https://cdn.example/new-lib.js, which no package"):
        D.localize(tmp_path, tmp_path / "cache")
    assert (tmp_path / "index.html").read_text() == page
