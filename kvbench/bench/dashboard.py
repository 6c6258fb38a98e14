"""Publish kvbench's asv dashboard so that it shows without the Internet.

asv 0.6's ``index.html`` loads jQuery, flot, stupidtable, md5 and bootstrap from public CDNs
(code.jquery.com, cdnjs.cloudflare.com, cdn.jsdelivr.net): where those cannot be reached the
page stays blank. ``python -m kvbench.bench.dashboard`` runs ``asv publish`` and then serves
those files from the published folder itself: each comes from its npm package, pinned by
version and by the tarball's sha512 (npm's ``dist.integrity``), fetched from the npm registry
once into a cache (or put there by hand: ``npm pack jquery@3.3.1 ...``), and each CDN address
in ``index.html`` is rewritten to the copy under ``vendor/``.

Where the npm file is the very file the CDN serves (jQuery, orderBars, md5, bootstrap: asv's
own integrity hashes match them) that is checked too; flot's CDN files are cdnjs's minified
builds, so its npm sources are served, and stupidtable 1.0.1 is not on npm: 1.1.3, the same
``$.fn.stupidtable`` API, stands in for it.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

REGISTRY = "https://registry.npmjs.org"
# beside asv's own environments (.asv/env), relative to where asv runs; ignored by git
CACHE_DIR = Path(".asv") / "npm"
VENDOR = "vendor"  # the published folder's copies, one folder per package@version


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    integrity: str  # the tarball's, as `npm view NAME@VERSION dist.integrity` prints it
    files: dict  # {CDN address in asv's index.html: the file in the tarball (under package/)}
    extra: tuple = ()  # tarball folders copied too (bootstrap's css loads ../fonts/)

    @property
    def tarball(self) -> str:
        return f"{self.name}-{self.version}.tgz"

    @property
    def folder(self) -> str:
        return f"{self.name}@{self.version}"


PACKAGES = (
    Package("jquery", "3.3.1",
            "sha512-Ubldcmxp5np52/ENotGxlLe6aGMvmF4R8S6tZjsP6Knsaxd/xp3Zrh50cG93lR6nPXyUFwzN3ZSOQI0wRJNdGg==",
            {"https://code.jquery.com/jquery-3.3.1.min.js": "dist/jquery.min.js"}),
    Package("flot", "0.8.3",
            "sha512-xg2otcTJDvS+ERK+my4wxG/ASq90QURXtoM4LhacCq0jQW2jbyjdttbRNqU2cPykrpMvJ6b2uSp6SAgYAzj9tQ==",
            {f"https://cdnjs.cloudflare.com/ajax/libs/flot/0.8.3/jquery.flot{part}.min.js":
             f"jquery.flot{part}.js" for part in ("", ".time", ".selection", ".categories")}),
    Package("flot-orderbars", "1.0.0",
            "sha512-Jv51fvzevUjNXEeozpwEKfPjhiZhfiJddv0WHjduUTCmSF+7T5K7C9c9Y1wIVmUhDBv5fLMjgbwKecT0GIKPZA==",
            {"https://cdn.jsdelivr.net/npm/flot-orderbars@1.0.0/js/jquery.flot.orderBars.js":
             "js/jquery.flot.orderBars.js"}),
    Package("stupid-table-plugin", "1.1.3",
            "sha512-2Vk7XouQPxUQPRe9w0Fu7ZZ8kHLK7rDoLMsCgtKxRNJ7f4dSOGvW9CkHsq5wD6QsaEnWoyLBYH3xOEsrK3yWBg==",
            {"https://cdnjs.cloudflare.com/ajax/libs/stupidtable/1.0.1/stupidtable.min.js":
             "stupidtable.min.js"}),
    Package("blueimp-md5", "2.19.0",
            "sha512-DRQrD6gJyy8FbiE4s+bDoXS9hiW3Vbx5uCdwvcCf3zLHL+Iv7LtGHLpr+GZV8rHG8tK766FGYBwRbu8pELTt+w==",
            {"https://cdnjs.cloudflare.com/ajax/libs/blueimp-md5/2.19.0/js/md5.min.js": "js/md5.min.js"}),
    Package("bootstrap", "3.1.1",
            "sha512-TAzqS8E/ISpVHP29gYhy+1NSV+FJwApDVQhDfgLYsIuUDJiqJzH2DfORN5tiu+Ie2iBLrzEG34t4Rf465cigqg==",
            {"https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/js/bootstrap.min.js": "dist/js/bootstrap.min.js",
             "https://cdn.jsdelivr.net/npm/bootstrap@3.1.1/dist/css/bootstrap.min.css": "dist/css/bootstrap.min.css"},
            extra=("dist/fonts/",)),
)

# a script or stylesheet tag's address outside the published folder (asv's GitHub link is an <a>)
REMOTE = re.compile(r'<(?:script|link)\b[^>]*?\b(?:src|href)="(https?://[^"]+)"[^>]*>')


class DashboardError(RuntimeError):
    """The dashboard cannot be made to show offline (a file missing, a hash that differs)."""


class Unreachable(DashboardError):
    """A pinned package is not in the cache and the npm registry cannot be reached."""


def sri(data: bytes, algorithm: str = "sha512") -> str:
    return f"{algorithm}-" + base64.b64encode(hashlib.new(algorithm, data).digest()).decode()


def tarball(package: Package, cache: Path) -> bytes:
    """The package's tarball from ``cache``, else from the npm registry (then kept in
    ``cache``); a DashboardError when it cannot be had or is not the pinned one."""
    path = cache / package.tarball
    if path.exists():
        data = path.read_bytes()
    else:
        url = f"{REGISTRY}/{package.name}/-/{package.tarball}"
        try:
            with urllib.request.urlopen(url, timeout=60) as response:
                data = response.read()
        except (urllib.error.URLError, OSError) as e:
            raise Unreachable(
                f"{package.folder}: not in {cache} and the npm registry cannot be reached ({url}: "
                f"{e}); where it can: `npm pack {package.folder}`, then copy the .tgz into {cache}") from e
    algorithm = package.integrity.split("-", 1)[0]
    if sri(data, algorithm) != package.integrity:
        raise DashboardError(f"{path if path.exists() else package.tarball}: not the pinned "
                             f"{package.folder} ({algorithm} {sri(data, algorithm)}, pinned "
                             f"{package.integrity}); delete it to fetch it again")
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return data


def _unpack(package: Package, data: bytes, into: Path) -> None:
    """The package's files (and its extra folders) into ``into``/vendor/NAME@VERSION/."""
    wanted = set(package.files.values())
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            rel = member.name.removeprefix("package/")
            if member.isfile() and (rel in wanted or rel.startswith(package.extra or ("\0",))):
                wanted.discard(rel)
                dest = into / VENDOR / package.folder / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tar.extractfile(member).read())
    if wanted:
        raise DashboardError(f"{package.folder}: its tarball has no {', '.join(sorted(wanted))}")


def localize(html_dir: Path | str, cache: Path | str = CACHE_DIR) -> list[str]:
    """Rewrite ``html_dir``/index.html (as `asv publish` wrote it) to load every script and
    stylesheet from the folder itself; the CDN addresses it replaced. A DashboardError names
    an address that no pinned package provides (a newer asv's), leaving index.html as it was."""
    html_dir, cache = Path(html_dir), Path(cache)
    index = html_dir / "index.html"
    if not index.exists():
        raise DashboardError(f"{index}: no such file (run `asv publish` first)")
    page = index.read_text(encoding="utf-8")
    local = {url: f"{VENDOR}/{p.folder}/{rel}" for p in PACKAGES for url, rel in p.files.items()}
    unknown = sorted({m.group(1) for m in REMOTE.finditer(page)} - set(local))
    if unknown:
        raise DashboardError(f"{index}: loads {', '.join(unknown)}, which no package in "
                             f"kvbench/bench/dashboard.py provides (a newer asv?): pin one there")
    replaced = []
    for package in PACKAGES:
        if any(url in page for url in package.files):
            _unpack(package, tarball(package, cache), html_dir)
            replaced += [url for url in package.files if url in page]
    # The copies are served from the page's own origin: no CORS request (crossorigin), and no
    # integrity attribute, as some copies are not the CDN's bytes (checked by the tarball's hash)
    tag = re.compile(r'<(script|link)\b[^>]*>')

    def rewrite(m):
        text = m.group(0)
        for url in replaced:
            if f'"{url}"' in text:
                text = text.replace(f'"{url}"', f'"{local[url]}"')
                return re.sub(r'\s(?:integrity|crossorigin|referrerpolicy)="[^"]*"', "", text)
        return text

    index.write_text(tag.sub(rewrite, page), encoding="utf-8")
    return replaced


def html_dir_of(config: Path | str) -> Path:
    """The ``html_dir`` of an asv.conf.json, read by asv (relative to the working directory,
    as `asv publish` takes it)."""
    from asv.config import Config
    return Path(Config.load(str(config)).html_dir)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvbench.bench.dashboard",
        description="`asv publish`, then serve the dashboard's scripts from its own folder (pinned "
                    "npm packages), so that it shows without the Internet.")
    p.add_argument("--config", default="asv.conf.json", help="asv's configuration (default: %(default)s)")
    p.add_argument("--cache", default=str(CACHE_DIR),
                   help="where the npm tarballs are kept (default: %(default)s)")
    p.add_argument("asv_args", nargs=argparse.REMAINDER, help="passed to `asv publish`")
    args = p.parse_args(argv)
    run = subprocess.run([sys.executable, "-m", "asv", "publish", "--config", args.config,
                          *args.asv_args])
    if run.returncode:
        print(f"asv publish failed (exit {run.returncode})", file=sys.stderr)
        return run.returncode
    html = html_dir_of(args.config)
    try:
        replaced = localize(html, args.cache)
    except DashboardError as e:
        print(f"dashboard: {e}", file=sys.stderr)
        return 1
    print(f"dashboard: {len(replaced)} scripts and stylesheets served from {html / VENDOR} "
          f"(`asv preview --config {args.config}`, or any static file server)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
