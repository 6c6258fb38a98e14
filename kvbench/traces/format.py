"""The one trace format every backend, generator, loader and test shares (SPEC section 6).

Canonical form is JSONL: line 1 is the header, then one operation per line::

    {"kvbench_trace": 1, "family": "fork", "generator": "...", "params": {...}, "seed": 0, ...}
    {"step": 0, "op": "prefill", "seq": 0, "tenant": "a", "tokens": 40}
    {"step": 1, "op": "append", "seqs": [0], "tokens": [1]}
    {"step": 2, "op": "fork", "seq": 1, "src": 0}
    {"step": 3, "op": "free", "seq": 0}

A fork's child inherits the tenant of its source. ``block_hashes`` on a prefill (optional) names
the prompt's full blocks for prefix caching; ``token_ids`` (instead) gives the prompt's token ids,
from which a backend derives its own block hashes. ``salt`` (the tenant's cache salt) and
``adapter`` (a LoRA adapter's name) are extra keys of those hashes (SPEC §9): blocks are shared
only between prefills with the same salt and adapter. The header may name the model's KV cache
groups (``"groups": ["sliding(32)", "full"]``, SPEC §8). Large traces can be stored as CSV (one
row per sequence and step; a batched append is several rows with one step; the header is the
first line, ``# {json}``).

A field the format does not know (a typo: ``block_hash``), a key given twice on one line, a header
setting of the wrong type: each is refused with the file and the line, never ignored.

Over 500 lines: one parser per operation of the registry (kvbench.traces.ops) and the history
rules that tie them (a chunked prompt, pending drafts, a preempted sequence: SPEC §13) are read
together with the JSONL and CSV readers whose line numbers their errors name.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
from array import array
from dataclasses import dataclass, field
from typing import Iterable, Iterator

from kvbench.traces import columns as C
from kvbench.traces import tier_ops
from kvbench.traces.ops import (OPS, PREEMPT_MODES, Abort, Accept, Append, Done, Fork, Free, Load, Lookup, Op,
                                Preempt, Prefill, Resume, Store, final_lengths, op_to_dict)

from kvbench.outputs import staged
from kvbench.traces.inputs import (INT64_MAX, check_header, check_prefill, open_input, parse_json,
                                   text_lines)

FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)


class TraceError(ValueError):
    """A trace that cannot be replayed: names the file, the line and the reason."""

    def __init__(self, reason: str, path: str | None = None, line: int | None = None):
        self.reason, self.path, self.line = reason, path, line
        where = f"{path or '<trace>'}:{line}" if line is not None else (path or "<trace>")
        super().__init__(f"{where}: {reason}")


@dataclass
class Header:
    family: str
    generator: str = ""
    params: dict = field(default_factory=dict)
    seed: int | None = None
    tenants: dict = field(default_factory=dict)  # tenant -> weight (for Fair eviction)
    settings: dict = field(default_factory=dict)  # defaults for a run: SETTINGS names them
    version: int = FORMAT_VERSION
    groups: tuple = ()  # the model's KV cache group kinds, "full" / "sliding(W)" (SPEC §8)
    tiers: tuple = ()  # the lower tiers, a TierSpec each, tier 1 first (SPEC §11)

    def to_dict(self) -> dict:
        d = {"kvbench_trace": self.version, "family": self.family, "generator": self.generator,
             "params": self.params, "seed": self.seed}
        if self.tenants:
            d["tenants"] = self.tenants
        if self.settings:
            d["settings"] = self.settings
        if self.groups:
            d["groups"] = list(self.groups)
        if self.tiers:
            d["tiers"] = [t.to_dict() for t in self.tiers]
        return d


@dataclass
class Trace:
    """A header and its operations: a list of op objects (as code builds them), or an
    :class:`~kvbench.traces.columns.OpTable` (as traces load: columns, ops made on access)."""

    header: Header
    ops: list
    name: str = "trace"
    path: str | None = None  # the file it was read from: errors found later name it

    def __iter__(self) -> Iterator[Op]:
        return iter(self.ops)

    def __len__(self) -> int:
        return len(self.ops)

    def to_jsonl(self) -> str:
        return "".join(self.jsonl_lines())

    def jsonl_lines(self) -> Iterator[str]:
        yield json.dumps(self.header.to_dict()) + "\n"
        for op in self.ops:
            yield json.dumps(op_to_dict(op)) + "\n"

    def columnar(self) -> Trace:
        """The same trace with its operations as columns."""
        if isinstance(self.ops, C.OpTable):
            return self
        return Trace(self.header, C.OpTable.from_ops(self.ops), self.name)

    def names_prompt_blocks(self) -> bool:
        """Whether a prefill carries block hashes or token ids (columns: from their side tables)."""
        if isinstance(self.ops, C.OpTable):
            return any(self.ops.hashes.values()) or any(k[2] for k in self.ops.keys.values())
        return any(getattr(op, "block_hashes", None) or getattr(op, "token_ids", None) for op in self.ops)

    def final_lengths(self) -> dict:
        """Each sequence's length when it is freed or the trace ends: what the trace knows."""
        if isinstance(self.ops, C.OpTable):
            return self.ops.final_lengths()
        return final_lengths(self.ops)

    def tenant_of(self) -> dict:
        if isinstance(self.ops, C.OpTable):
            return self.ops.tenant_of()
        tenant = {}
        for op in self.ops:
            if isinstance(op, Prefill):
                tenant[op.seq] = op.tenant
            elif isinstance(op, Fork):
                tenant[op.seq] = tenant[op.src]
        return tenant


# --- parsing and validation -------------------------------------------------------------------

# The fields of each operation (anything else is refused: a typo must not silently drop a field).
OP_FIELDS = {kind: {"step", "op", *cls.FIELDS} for kind, cls in OPS.items()}


def _int(d: dict, key: str, fail, minimum: int | None = None) -> int:
    if key not in d:
        fail(f"missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, int):
        fail(f"field {key!r} must be an integer, got {v!r}")
    if minimum is not None and v < minimum:
        fail(f"field {key!r} must be >= {minimum}, got {v}")
    if v > INT64_MAX:
        fail(f"field {key!r} = {v} is outside int64 (at most 2**63 - 1)")
    return v


def parse_op(d: dict, fail) -> Op:
    if not isinstance(d, dict):
        fail(f"an operation must be a JSON object, got {type(d).__name__}")
    kind = d.get("op")
    if kind not in OPS:
        fail(f"unknown op {kind!r} (known: {', '.join(OPS)})")
    unknown = sorted(set(d) - OP_FIELDS[kind])
    if unknown:
        fail(f"unknown field {unknown[0]!r} of op {kind!r} (its fields: "
             f"{', '.join(sorted(OP_FIELDS[kind]))})")
    step = _int(d, "step", fail, minimum=0)
    return _PARSERS[kind](d, step, fail)


def _parse_prefill(d, step, fail) -> Prefill:
    tenant = d.get("tenant")
    if not isinstance(tenant, str) or not tenant:
        fail(f"prefill needs a non-empty string 'tenant', got {tenant!r}")
    hashes = d.get("block_hashes")
    if hashes is not None:
        if not isinstance(hashes, list):
            fail("'block_hashes' must be a list")
        for i, h in enumerate(hashes):
            if not ((isinstance(h, int) and not isinstance(h, bool)) or (isinstance(h, str) and h)):
                fail(f"block_hashes[{i}] must be an integer or a non-empty string, got {h!r}")
        hashes = tuple(hashes)
    tokens = _int(d, "tokens", fail, 0)  # an empty prompt: SPEC §13's operation of zero tokens
    prompt = None
    if d.get("prompt_tokens") is not None:
        prompt = _int(d, "prompt_tokens", fail, tokens)
    ids = d.get("token_ids")
    if ids is not None:
        if hashes is not None:
            fail("a prefill names either 'block_hashes' or 'token_ids', not both")
        whole = tokens if prompt is None else prompt
        if not isinstance(ids, list) or len(ids) != whole:
            fail(f"'token_ids' must be a list of {whole} ids (one per prompt token)")
        for i, t in enumerate(ids):
            _int({f"token_ids[{i}]": t}, f"token_ids[{i}]", fail, 0)
        ids = tuple(ids)
    extra = {}
    for key in ("salt", "adapter"):
        v = d.get(key)
        if v is not None and (not isinstance(v, str) or not v):
            fail(f"{key!r} must be a non-empty string, got {v!r}")
        extra[key] = v
    return Prefill(step, _int(d, "seq", fail, 0), tenant, tokens, hashes, token_ids=ids,
                   prompt_tokens=prompt, **extra)


def _parse_append(d, step, fail) -> Append:
    seqs, tokens, draft = d.get("seqs"), d.get("tokens"), d.get("draft")
    if not isinstance(seqs, list) or not isinstance(tokens, list):
        fail("append needs lists 'seqs' and 'tokens'")
    if not seqs:
        fail("append with an empty batch")
    if len(seqs) != len(tokens):
        fail(f"append has {len(seqs)} seqs but {len(tokens)} token counts")
    for i, (s, t) in enumerate(zip(seqs, tokens)):
        _int({"seq": s}, "seq", fail, 0)
        _int({f"tokens[{i}]": t}, f"tokens[{i}]", fail, 0)  # a member writing nothing this step
    if len(set(seqs)) != len(seqs):
        fail("append names a sequence twice in one batch")
    if draft is not None:
        if not isinstance(draft, list) or len(draft) != len(seqs):
            fail(f"'draft' must be a list of {len(seqs)} counts (one per sequence)")
        for i, k in enumerate(draft):
            _int({f"draft[{i}]": k}, f"draft[{i}]", fail, 0)
            if k > tokens[i]:
                fail(f"draft[{i}] = {k} draft tokens, more than the {tokens[i]} tokens it appends")
        draft = tuple(draft)
    return Append(step, tuple(seqs), tuple(tokens), draft)


def _parse_fork(d, step, fail) -> Fork:
    return Fork(step, _int(d, "seq", fail, 0), _int(d, "src", fail, 0))


def _parse_free(d, step, fail) -> Free:
    return Free(step, _int(d, "seq", fail, 0))


def _parse_accept(d, step, fail) -> Accept:
    return Accept(step, _int(d, "seq", fail, 0), _int(d, "n", fail, 0))


def _parse_preempt(d, step, fail) -> Preempt:
    mode = d.get("mode", "recompute")
    if mode not in PREEMPT_MODES:
        fail(f"preempt mode {mode!r} is not known ({', '.join(PREEMPT_MODES)})")
    tier = d.get("tier")
    if tier is not None and (mode != "swap" or not isinstance(tier, str) or not tier):
        fail(f"'tier' names the tier a swap moves the sequence to (mode 'swap', a tier's name), "
             f"got tier {tier!r} with mode {mode!r}")
    return Preempt(step, _int(d, "seq", fail, 0), mode, tier)


def _parse_resume(d, step, fail) -> Resume:
    return Resume(step, _int(d, "seq", fail, 0))


def _parse_store(d, step, fail) -> Store:
    tier = d.get("tier")
    if not isinstance(tier, str) or not tier:
        fail(f"store needs the name of a tier, 'tier', got {tier!r}")
    blocks = d.get("blocks")
    if blocks is not None:
        if not isinstance(blocks, list) or not blocks:
            fail("'blocks' must be a non-empty list of block positions")
        for i, b in enumerate(blocks):
            _int({f"blocks[{i}]": b}, f"blocks[{i}]", fail, 0)
        if len(set(blocks)) != len(blocks):
            fail("'blocks' names a position twice")
        blocks = tuple(blocks)
    return Store(step, _int(d, "id", fail, 0), _int(d, "seq", fail, 0), tier, blocks)


def _parse_load(d, step, fail) -> Load:
    p = _parse_prefill(d, step, fail)
    return Load(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)}, id=_int(d, "id", fail, 0))


def _parse_lookup(d, step, fail) -> Lookup:
    p = _parse_prefill(d, step, fail)
    return Lookup(**{f.name: getattr(p, f.name) for f in dataclasses.fields(p)})


def _parse_done(d, step, fail) -> Done:
    ok = d.get("ok", True)
    if not isinstance(ok, bool):
        fail(f"field 'ok' must be true or false, got {ok!r}")
    return Done(step, _int(d, "id", fail, 0), ok)


def _parse_abort(d, step, fail) -> Abort:
    return Abort(step, _int(d, "seq", fail, 0))


_PARSERS = {kind: globals()[f"_parse_{kind}"] for kind in OPS}


class _Validator:
    """Checks the history: ids live and unique, steps strictly increasing; a chunked prompt,
    pending draft tokens and a preempted sequence take only the operations that may follow
    them (SPEC §13)."""

    def __init__(self, tiers: tuple = ()):
        self.live: set = set()
        self.seen: set = set()
        self.last_step = -1
        self.transfers = tier_ops.TransferHistory(tiers)  # SPEC §11's begin / completion rules
        self.chunk_left: dict = {}  # sequence -> tokens of its chunked prompt not yet written
        self.drafted: dict = {}  # sequence -> draft tokens of its last append, not yet accepted
        self.preempted: set = set()

    def check(self, op: Op, fail) -> None:
        if op.step <= self.last_step:
            fail(f"step {op.step} is out of order (previous step {self.last_step})")
        if not self.transfers.check(op, self.live, fail):  # True: a store or a completion, done
            getattr(self, op.kind)(op, fail)
        self.last_step = op.step

    def _live(self, seq, what, fail, *, busy=True) -> None:
        """``seq`` must be live; ``busy``: and neither preempted nor waiting for an accept."""
        if seq not in self.live:
            fail(f"{what} {'freed' if seq in self.seen else 'unknown'} sequence {seq}")
        if busy and seq in self.preempted:
            fail(f"{what} preempted sequence {seq} (resume it first)")
        if busy and seq in self.drafted:
            fail(f"{what} sequence {seq}, whose {self.drafted[seq]} draft tokens wait for an accept")

    def _new(self, seq, fail) -> None:
        if seq in self.seen:
            fail(f"duplicate sequence id {seq}")
        self.live.add(seq)
        self.seen.add(seq)

    def prefill(self, op, fail) -> None:
        self._new(op.seq, fail)
        if op.prompt_tokens is not None and op.prompt_tokens > op.tokens:
            self.chunk_left[op.seq] = op.prompt_tokens - op.tokens

    def append(self, op, fail) -> None:
        for i, s in enumerate(op.seqs):
            self._live(s, "append to", fail)
            left = self.chunk_left.get(s)
            if left is not None and op.tokens[i] > left:
                fail(f"append of {op.tokens[i]} tokens to sequence {s}, whose chunked prompt has "
                     f"{left} left (a chunk ends at the prompt's end)")
            if left is not None and op.draft is not None and op.draft[i]:
                fail(f"draft tokens for sequence {s} before its chunked prompt is complete")
        for i, s in enumerate(op.seqs):
            if s in self.chunk_left:
                self.chunk_left[s] -= op.tokens[i]
                if not self.chunk_left[s]:
                    del self.chunk_left[s]
            if op.draft is not None and op.draft[i]:
                self.drafted[s] = op.draft[i]

    def fork(self, op, fail) -> None:
        if op.seq in self.seen:
            fail(f"duplicate sequence id {op.seq}")
        self._live(op.src, "fork from", fail)
        if op.src in self.chunk_left:
            fail(f"fork from sequence {op.src} before its chunked prompt is complete")
        self._new(op.seq, fail)

    def free(self, op, fail) -> None:
        if self.transfers.looked_up.pop(op.seq, None) is not None:  # before its load: a cancel
            return
        self._live(op.seq, f"{op.kind} of", fail, busy=False)  # an abort is a free that says so
        self.live.discard(op.seq)
        for state in (self.chunk_left, self.drafted):
            state.pop(op.seq, None)
        self.preempted.discard(op.seq)

    def accept(self, op, fail) -> None:
        self._live(op.seq, "accept of", fail, busy=False)
        k = self.drafted.get(op.seq)
        if k is None:
            fail(f"accept of sequence {op.seq} without a pending speculative append (no draft "
                 f"tokens since its last accept)")
        if op.n > k:
            fail(f"accept keeps n = {op.n} draft tokens of sequence {op.seq}, which has only "
                 f"k = {k} (n <= k)")
        del self.drafted[op.seq]

    def preempt(self, op, fail) -> None:
        self._live(op.seq, "preempt of", fail)
        if op.seq in self.chunk_left:
            fail(f"preempt of sequence {op.seq} during its chunked prompt")
        if op.mode == "swap":  # to a lower tier of SPEC §11: the header must name one
            names = self.transfers.tier_names
            if not names:
                fail(f"preempt of sequence {op.seq} by swap in a trace whose header declares no "
                     f"'tiers' (a swap moves its blocks to a lower tier, SPEC §11)")
            if op.tier is not None and op.tier not in names:
                fail(f"swap of sequence {op.seq} to tier {op.tier!r}, which the header does not "
                     f"declare (tiers: {', '.join(sorted(names))})")
        self.preempted.add(op.seq)

    def resume(self, op, fail) -> None:
        self._live(op.seq, "resume of", fail, busy=False)
        if op.seq not in self.preempted:
            fail(f"resume of sequence {op.seq}, which is not preempted")
        self.preempted.discard(op.seq)

    def lookup(self, op, fail) -> None:  # the transfer rules saw to the rest
        if op.seq in self.seen:
            fail(f"lookup of freed sequence {op.seq} (a lookup names the request its load makes)")

    load = prefill  # a prefill served from the lower tiers: a new sequence as any prefill
    abort = free  # a free that cancels its loads (the transfer rules saw to those)


def parse_header(d, fail) -> Header:
    if not isinstance(d, dict) or "kvbench_trace" not in d:
        fail("the first line must be a header object with 'kvbench_trace' (the format version)")
    version = d["kvbench_trace"]
    if version not in SUPPORTED_VERSIONS:
        fail(f"trace format version {version!r} is not known (this kvbench reads {SUPPORTED_VERSIONS})")
    check_header(d, fail)
    tenants, groups = d.get("tenants") or {}, d.get("groups") or ()
    return Header(family=d["family"], generator=d.get("generator", ""), params=d.get("params") or {},
                  seed=d.get("seed"), tenants=tenants, settings=d.get("settings") or {},
                  version=version, groups=tuple(groups),
                  tiers=tier_ops.parse_tiers(d.get("tiers"), fail))


def validate(trace: Trace, path: str | None = None) -> Trace:
    """Validate an in-memory trace (ops built by code); line numbers count the header as 1.
    Columns are checked with array operations, and op by op only to name an error found."""
    if isinstance(trace.ops, C.OpTable):
        _check_history(trace.ops, path or trace.name, None, fields=True, tiers=trace.header.tiers)
        return trace
    v = _Validator(trace.header.tiers)
    for i, op in enumerate(trace.ops):
        def fail(reason, _line=i + 2):
            raise TraceError(reason, path or trace.name, _line)
        parse_op(op_to_dict(op), fail)  # field values: lengths >= 1, ids >= 0, ...
        v.check(op, fail)
    return trace


def _check_history(table, path, lines, *, fields: bool, upto: int | None = None,
                   tiers: tuple = ()) -> None:
    """Raise the TraceError of the first operation (before ``upto``) that breaks the history
    rules; ``lines``: each operation's line number (None: index + 2); ``tiers``: the header's."""
    bad = C.first_invalid(table)
    if bad is None or (upto is not None and bad >= upto):
        return
    if table.side:  # lifecycle operations and transfers: the scalar rules over the whole history
        bad = len(table) - 1 if upto is None else min(upto, len(table)) - 1
    v = _Validator(tiers)
    for i, op in enumerate(table):  # the scalar rules, to name the error
        def fail(reason, _line=lines[i] if lines is not None else i + 2):
            raise TraceError(reason, path, _line)
        if fields:
            parse_op(op_to_dict(op), fail)
        v.check(op, fail)
        if i == bad:
            break
    if table.side:
        return
    raise TraceError("the history is invalid (found by the columnar check, not named by the "
                     "operation-by-operation one: please report)", path, lines[bad] if lines is not None else bad + 2)


def _batch_row(d, b) -> bool:
    """Store a well-formed append straight into the columns (checks at C speed: int elements,
    ids >= 0, tokens >= 0, no id twice); False leaves the line to parse_op, which names what
    is wrong with it."""
    if type(d) is not dict or d.get("op") != "append":
        return False
    step, seqs, toks = d.get("step"), d.get("seqs"), d.get("tokens")
    if not (len(d) == 4 and type(step) is int and step >= 0 and type(seqs) is list and type(toks) is list
            and seqs and len(seqs) == len(toks) and set(map(type, seqs)) == {int}
            and set(map(type, toks)) == {int} and min(seqs) >= 0 and min(toks) >= 0
            and max(seqs) < 1 << 63 and max(toks) < 1 << 63 and len(set(seqs)) == len(seqs)):
        return False
    b.row(C.APPEND, step, seqs=seqs, toks=toks)
    return True


def loads(text: str, path: str | None = None) -> Trace:
    """Parse and validate a JSONL trace; the first bad line raises TraceError."""
    return read_jsonl(text.splitlines(), path)


def read_jsonl(lines: Iterable[str], path: str | None = None) -> Trace:
    """A JSONL trace from its lines (any iterable: a file streams), into columns. Each line's
    fields are checked as it is read; the history (live ids, step order) once, by columns."""
    header, b, where = None, C.TableBuilder(), array("q")
    try:
        for lineno, raw in enumerate(lines, start=1):
            def fail(reason, _line=lineno):
                raise TraceError(reason, path, _line)
            if not raw.strip():
                continue
            d = parse_json(raw, fail)
            if header is None:
                header = parse_header(d, fail)
                continue
            if not _batch_row(d, b):
                op = parse_op(d, fail)
                check_prefill(header, d, fail)
                b.add(op)
            where.append(lineno)
    except TraceError as e:  # a history error on an earlier line comes first
        _check_history(b.table(), path, where, fields=False, tiers=header.tiers if header else ())
        raise e
    if header is None:
        raise TraceError("empty trace: no header line", path, 1)
    table = b.table()
    _check_history(table, path, where, fields=False, tiers=header.tiers)
    name = os.path.splitext(os.path.basename(path))[0] if path else "trace"
    return Trace(header, table, name=name, path=path)


# --- CSV (flat, for large traces) -------------------------------------------------------------

CSV_COLUMNS = ["step", "op", "seq", "tenant", "tokens", "src"]
CSV_OPS = ("prefill", "append", "fork", "free")  # the operations its columns can hold


def to_csv(trace: Trace) -> str:
    return "".join(csv_lines(trace))


def csv_lines(trace: Trace) -> Iterator[str]:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")

    def take():
        text = out.getvalue()
        out.seek(0)
        out.truncate()
        return text

    yield "# " + json.dumps(trace.header.to_dict()) + "\n"
    w.writerow(CSV_COLUMNS)
    for op in trace.ops:
        if op.kind not in CSV_OPS or getattr(op, "draft", None) is not None:
            raise TraceError(f"step {op.step}: CSV holds no {op.kind} {'draft ' if op.kind == 'append' else ''}"
                             f"operation: save the trace as .jsonl", trace.name)
        if isinstance(op, Prefill):
            if (op.salt is not None or op.adapter is not None or op.token_ids is not None
                    or op.prompt_tokens is not None or op.block_hashes is not None):
                raise TraceError(f"step {op.step}: CSV holds no block hashes, salt, adapter, token "
                                 f"ids or chunked prompt: save the trace as .jsonl", trace.name)
            w.writerow([op.step, "prefill", op.seq, op.tenant, op.tokens, ""])
        elif isinstance(op, Append):
            for s, t in zip(op.seqs, op.tokens):
                w.writerow([op.step, "append", s, "", t, ""])
        elif isinstance(op, Fork):
            w.writerow([op.step, "fork", op.seq, "", "", op.src])
        else:
            w.writerow([op.step, "free", op.seq, "", "", ""])
        if out.tell() > 1 << 16:
            yield take()
    yield take()


def loads_csv(text: str, path: str | None = None) -> Trace:
    return read_csv(text.splitlines(), path)


def read_csv(lines: Iterable[str], path: str | None = None) -> Trace:
    """A CSV trace from its lines (any iterable: a file streams), into columns."""
    lines = iter(lines)
    first = next(lines, "")
    if not first.startswith("#"):
        raise TraceError("the first line must be '# {header json}'", path, 1)

    def fail_at(line):
        def fail(reason):
            raise TraceError(reason, path, line)
        return fail

    header = parse_header(parse_json(first[1:], lambda reason: fail_at(1)(f"header is {reason}")),
                          fail_at(1))
    reader = csv.DictReader(lines)
    if reader.fieldnames is None or sorted(reader.fieldnames) != sorted(CSV_COLUMNS):
        raise TraceError(f"columns must be {CSV_COLUMNS}, got {reader.fieldnames}", path, 2)
    b, where = C.TableBuilder(), array("q")
    batch: dict | None = None
    batch_line = 0

    def add(d, line):
        op = parse_op(d, fail_at(line))
        check_prefill(header, d, fail_at(line))
        b.add(op)
        where.append(line)

    def flush():
        nonlocal batch
        if batch is not None:
            add(batch, batch_line)
            batch = None

    try:
        for i, row in enumerate(reader, start=3):
            fail = fail_at(i)
            try:
                rec = {k: (int(row[k]) if row[k] not in ("", None) and k in ("step", "seq", "tokens", "src")
                           else row[k]) for k in CSV_COLUMNS}
            except ValueError as e:
                fail(f"not an integer: {e}")
            if rec["op"] == "append":
                if batch is not None and batch["step"] == rec["step"]:
                    batch["seqs"].append(rec["seq"])
                    batch["tokens"].append(rec["tokens"])
                    continue
                flush()
                batch = {"step": rec["step"], "op": "append", "seqs": [rec["seq"]], "tokens": [rec["tokens"]]}
                batch_line = i
                continue
            flush()
            add({k: v_ for k, v_ in rec.items() if v_ not in ("", None)}, i)
        flush()
    except TraceError as e:  # a history error on an earlier line comes first
        _check_history(b.table(), path, where, fields=False)
        raise e
    table = b.table()
    _check_history(table, path, where, fields=False)
    name = os.path.splitext(os.path.basename(path))[0] if path else "trace"
    return Trace(header, table, name=name, path=path)


def load(path: str) -> Trace:
    """Load a trace file: .jsonl (canonical) or .csv, streamed into columns (a file larger
    than memory loads into arrays of a few dozen bytes per operation)."""
    def fail(reason, line):
        raise TraceError(reason, path, line)

    with open_input(path, fail) as f:
        lines = text_lines(f, fail)
        return read_csv(lines, path) if path.endswith(".csv") else read_jsonl(lines, path)


def save(trace: Trace, path: str) -> None:
    """Write ``trace`` to ``path`` (.csv or .jsonl) under a temporary name, renamed when complete."""
    lines = csv_lines(trace) if path.endswith(".csv") else trace.jsonl_lines()
    with staged(path) as (tmp,):
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(lines)
