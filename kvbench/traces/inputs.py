"""What a trace file must be before its operations are parsed: a file (not a device: /dev/zero
would be read forever), UTF-8 text without a byte-order mark in lines of bounded length, JSON
without a key given twice, a header whose fields and settings have their types, and prefill lines
that agree with the header (declared tenants, no more block hashes than full blocks). Each check
reports through ``fail`` (kvbench.traces.format raises its TraceError)."""
from __future__ import annotations

import json
import os
import stat

from kvbench.contract.formulas import MAX_BLOCK_SIZE, get_model, parse_kind

INT64_MAX = (1 << 63) - 1  # ids, steps and lengths are stored as int64

# The longest line read (a prompt of a few million token ids): past it, the file is not a trace.
MAX_LINE_BYTES = 1 << 26


def open_input(path: str, fail):
    """``path`` opened for reading in binary; ``fail(reason, line)`` for a device or a socket (a
    FIFO streams, and the line bound keeps a stream without newlines from growing forever)."""
    mode = os.stat(path).st_mode  # a missing file: FileNotFoundError, which names it
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISSOCK(mode):
        kind = "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else "a socket"
        fail(f"{kind}, not a trace file", None)
    if stat.S_ISDIR(mode):
        fail("a folder, not a trace file", None)
    return open(path, "rb")


def check_prefill(header, d: dict, fail) -> None:
    """What a prefill line must agree with in its header: a declared tenant (when the header
    declares tenants), and no more block hashes than the prompt's full blocks at the header's
    block size."""
    if d.get("op") not in ("prefill", "load"):
        return
    if header.tenants and d.get("tenant") not in header.tenants:
        fail(f"tenant {d.get('tenant')!r} is not declared in the header's 'tenants' "
             f"({', '.join(map(repr, header.tenants))})")
    hashes = d.get("block_hashes")
    tokens = d.get("prompt_tokens") or d.get("tokens")  # a chunked prompt's hashes cover it whole
    if isinstance(hashes, list) and isinstance(tokens, int):
        bs = header.settings.get("block_size", 16)
        if len(hashes) > tokens // bs:
            fail(f"{len(hashes)} block_hashes for {tokens} tokens: a prompt of {tokens} "
                 f"tokens has {tokens // bs} full blocks of {bs} (the header's block size)")


def text_lines(f, fail):
    """The lines of a binary file as text: UTF-8 without a byte-order mark, else
    ``fail(reason, line)`` (a binary file, a file saved with a BOM)."""
    for lineno, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), start=1):
        if len(raw) > MAX_LINE_BYTES:
            fail(f"a line longer than {MAX_LINE_BYTES:,} bytes: is this a kvbench trace?", lineno)
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            fail("the file starts with a UTF-8 byte-order mark: save it as UTF-8 without one", 1)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): is this a "
                 f"kvbench trace?", lineno)
        yield text


HEADER_FIELDS = ("kvbench_trace", "family", "generator", "params", "seed", "tenants", "settings",
                 "groups", "tiers")
# The header's settings (defaults of a run) and their types: a positive integer up to a bound,
# a flag, or a name.
SETTINGS = {"model": str, "block_size": MAX_BLOCK_SIZE, "num_blocks": INT64_MAX,
            "max_context": INT64_MAX, "prefix_caching": bool, "store_kv": bool, "policy": str,
            "kv_format": str}  # kv_format: a quantized pool's (a fuzz finding in one of its formats)


def _unique_keys(pairs) -> dict:
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {twice!r} is given twice (which one is meant?)")
    return d


_DECODER = json.JSONDecoder(object_pairs_hook=_unique_keys)


def parse_json(text: str, fail):
    """One line's JSON value; ``fail`` for invalid JSON, a key given twice in one object, or
    nesting deeper than the parser's recursion allows."""
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as e:
        fail(f"not valid JSON: {e.msg}")
    except ValueError as e:
        fail(f"not valid JSON for kvbench: {e}")
    except RecursionError:
        fail("not valid JSON for kvbench: nested too deeply for the parser (a trace line nests "
             "two or three levels)")


def check_header(d: dict, fail) -> None:
    """The header's fields (its version aside) of the types they must be, else ``fail``."""
    unknown = sorted(set(d) - set(HEADER_FIELDS))
    if unknown:
        fail(f"unknown header field {unknown[0]!r} (the header's fields: {', '.join(HEADER_FIELDS)})")
    family = d.get("family")
    if not isinstance(family, str) or not family:
        fail("header needs a non-empty 'family'")
    for key, kind in (("generator", str), ("params", dict), ("tenants", dict), ("settings", dict)):
        if d.get(key) is not None and not isinstance(d[key], kind):
            fail(f"header field {key!r} must be {'a string' if kind is str else 'an object'}, "
                 f"got {d[key]!r}")
    seed = d.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        fail(f"header field 'seed' must be an integer, got {seed!r}")
    tenants = d.get("tenants") or {}
    for t, w in tenants.items():
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not w > 0:
            fail(f"tenant {t!r} weight must be a positive number, got {w!r}")
    groups = d.get("groups")
    if groups is not None:
        if not isinstance(groups, list) or not groups:
            fail("'groups' must be a non-empty list of group kinds (\"full\", \"sliding(W)\")")
        for g in groups:
            try:
                parse_kind(g)  # every argument a positive int64
            except ValueError as e:
                fail(f"'groups': {e}")
    for key, value in (d.get("settings") or {}).items():
        _check_setting(key, value, fail)


def _check_setting(key: str, value, fail) -> None:
    """A header setting of the type SETTINGS gives it, else ``fail`` naming it."""
    if key not in SETTINGS:
        fail(f"unknown setting {key!r} (the settings: {', '.join(SETTINGS)})")
    kind = SETTINGS[key]
    if kind is bool:
        if not isinstance(value, bool):
            fail(f"setting {key!r} must be true or false, got {value!r}")
    elif kind is str:
        if not isinstance(value, str) or not value:
            fail(f"setting {key!r} must be a non-empty string, got {value!r}")
        if key == "model":
            try:
                get_model(value)
            except ValueError as e:
                fail(f"setting 'model': {e}")
    elif isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= kind:
        most = f" (at most {kind:,})" if kind < INT64_MAX else ""
        fail(f"setting {key!r} must be a positive integer{most}, got {value!r}")
