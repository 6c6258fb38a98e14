"""What a trace file must be before its operations are parsed: a file (not a device: /dev/zero
would be read forever), UTF-8 text without a byte-order mark in lines of bounded length, and
prefill lines that agree with the header (declared tenants, no more block hashes than full
blocks). Each check reports through ``fail`` (kvbench.traces.format raises its TraceError)."""
from __future__ import annotations

import os
import stat

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
    if d.get("op") != "prefill":
        return
    if header.tenants and d.get("tenant") not in header.tenants:
        fail(f"tenant {d.get('tenant')!r} is not declared in the header's 'tenants' "
             f"({', '.join(map(repr, header.tenants))})")
    hashes = d.get("block_hashes")
    if isinstance(hashes, list) and isinstance(d.get("tokens"), int):
        bs = header.settings.get("block_size", 16)
        if len(hashes) > d["tokens"] // bs:
            fail(f"{len(hashes)} block_hashes for {d['tokens']} tokens: a prompt of {d['tokens']} "
                 f"tokens has {d['tokens'] // bs} full blocks of {bs} (the header's block size)")


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
