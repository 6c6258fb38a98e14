"""What a trace file must be before its operations are parsed: UTF-8 text without a byte-order
mark, and prefill lines that agree with the header (declared tenants, no more block hashes than
full blocks). Each check reports through ``fail`` (kvbench.traces.format raises its TraceError)."""
from __future__ import annotations


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
    for lineno, raw in enumerate(f, start=1):
        if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):
            fail("the file starts with a UTF-8 byte-order mark: save it as UTF-8 without one", 1)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}): is this a "
                 f"kvbench trace?", lineno)
        yield text
