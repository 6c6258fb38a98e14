"""The formulas of SPEC sections 1-2, 8 and 12, as small pure functions.

Every backend and the oracle are checked against these; none of them holds state.

A model's layers form one or more KV cache groups (SPEC §8): every layer of a group has the same
kind (§12: full, sliding(W), chunked(C), sinks(S, W), mla(d), state(bytes), compressed(r)), and
every group holds
the same number of layers, so one pool of equal-size blocks serves them all. A group's block
holds ``B`` tokens of its layers; where groups' blocks differ in size, the pool pads every page to
the largest, or keeps one pool per page size, as the model declares (``ModelSpec.pages``).
A model without ``groups`` is one full-attention group of all its layers.

Over 500 lines: the formulas of SPEC §1-2, §8 and §12 and the presets with their cited configs
are checked together (each backend, the oracle and `kvbench list-models` state a formula once,
here); a kind's release, hit and capacity rules sit side by side so that they cannot drift.
"""
from __future__ import annotations

import dataclasses
import functools
import re
from dataclasses import dataclass
from fractions import Fraction

import numpy as np

# Tokens a block at most: slot and token arithmetic (blocks * block_size) stays within int64 for
# any pool a machine can index.
MAX_BLOCK_SIZE = (1 << 31) - 1


KIND_FAMILIES = ("full", "sliding", "chunked", "sinks", "mla", "state", "compressed")  # KVGroup.family


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group: the layers whose cache its blocks hold, and their kind (SPEC §8, §12).

    At most one of these is set; none is full attention. ``window = W``: sliding(W), the token
    at p attends to p - W + 1 .. p. ``chunk = C``: chunked(C), it attends to floor(p/C)*C .. p.
    ``sinks = (S, W)``: the first S tokens for good plus a window of W. ``latent = d``: mla(d),
    one latent of width d per token per layer (``latent_bytes``: the layout's bytes per token per
    layer where it is not d * s, as DeepSeek-V3's fp8 656). ``state_bytes``: state(bytes), one
    fixed state per live sequence per layer, whatever its length. ``compress = r``:
    compressed(r), one entry per r tokens (DeepSeek-V4's ``compress_ratio``): a block holds B
    entries covering B * r tokens.
    """

    layers: tuple
    window: int | None = None
    chunk: int | None = None
    sinks: tuple | None = None
    latent: int | None = None
    latent_bytes: int | None = None
    state_bytes: int | None = None
    compress: int | None = None

    def __post_init__(self):
        set_ = [f for f in ("window", "chunk", "sinks", "latent", "state_bytes", "compress")
                if getattr(self, f) is not None]
        if len(set_) > 1:
            raise ValueError(f"KVGroup {self.layers}: one kind per group, got {', '.join(set_)}")
        for f in ("window", "chunk", "latent", "latent_bytes", "state_bytes", "compress"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"KVGroup {self.layers}: {f} must be a positive int, got {v!r}")
        if self.latent_bytes is not None and self.latent is None:
            raise ValueError(f"KVGroup {self.layers}: latent_bytes is the layout of an mla(d) group")
        if self.sinks is not None:
            ok = (isinstance(self.sinks, tuple) and len(self.sinks) == 2
                  and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.sinks))
            if not ok:
                raise ValueError(f"KVGroup {self.layers}: sinks must be (S, W), two positive ints, "
                                 f"got {self.sinks!r}")

    @property
    def sliding(self) -> bool:
        return self.window is not None

    @property
    def family(self) -> str:
        """The kind without its parameters: full, sliding, chunked, sinks, mla, state or
        compressed."""
        for f, name in (("window", "sliding"), ("chunk", "chunked"), ("sinks", "sinks"),
                        ("latent", "mla"), ("state_bytes", "state"), ("compress", "compressed")):
            if getattr(self, f) is not None:
                return name
        return "full"

    @property
    def kind(self) -> str:
        """The kind as a trace header names it: full, sliding(W), chunked(C), sinks(S,W), ..."""
        arg = {"full": None, "sliding": self.window, "chunked": self.chunk, "mla": self.latent,
               "state": self.state_bytes, "compressed": self.compress,
               "sinks": None if self.sinks is None else f"{self.sinks[0]},{self.sinks[1]}"}[self.family]
        return self.family if arg is None else f"{self.family}({arg})"

    @property
    def releases(self) -> bool:
        """Whether the group gives blocks back while its sequence lives (SPEC §8, §12; a state
        group keeps only the block of its last token, the state there)."""
        return self.family in ("sliding", "chunked", "sinks", "state")

    @property
    def per_token(self) -> bool:
        """False for a state group: its size does not grow with the sequence."""
        return self.state_bytes is None

    @property
    def ratio(self) -> int:
        """r: tokens per entry (1 but for compressed(r))."""
        return self.compress or 1


# KV formats (SPEC §12): the element encoding of K/V, metadata counted. "native": dtype_bytes per
# element; "fp8" (e4m3): 1 byte per element and one float32 scale per layer for K and for V;
# "fp8-per-token-head": 1 byte per element and a float32 scale per head per token; "nvfp4": 4-bit
# codes (d/2 bytes) and one fp8 scale per 16 elements (d/16 bytes) per head per token, plus a
# float32 per-tensor scale per layer for K and for V.
KV_ENCODINGS = ("native", "fp8", "fp8-per-token-head", "nvfp4")
SCALE_BYTES = 4  # a float32 scale
PAGES = ("padded", "pools")  # unequal groups: pad every page to the largest, or one pool per size


def head_token_bytes(head_dim: int, dtype_bytes: int, encoding: str = "native") -> int:
    """Bytes of one head of one token of K (or V) in a KV format, its per-token metadata counted."""
    if encoding == "native":
        return head_dim * dtype_bytes
    if encoding == "fp8":
        return head_dim
    if encoding == "fp8-per-token-head":
        return head_dim + SCALE_BYTES
    if encoding == "nvfp4":
        if head_dim % 16:
            raise ValueError(f"nvfp4 takes one scale per 16 elements: head_dim {head_dim} is not "
                             f"a multiple of 16")
        return head_dim // 2 + head_dim // 16
    raise ValueError(f"unknown KV encoding {encoding!r} (one of {', '.join(KV_ENCODINGS)})")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a model's KV cache: layers, KV heads, head dim, bytes per element, the KV
    cache groups its layers form (empty: one full-attention group of every layer), the K/V
    encoding (``KV_ENCODINGS``) and how pages of unequal groups are kept (``PAGES``)."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int = 2  # fp16 / bf16
    groups: tuple = ()
    kv_encoding: str = "native"
    pages: str = "padded"
    # The derived figures below are cached (a frozen spec's never change): pools and the checker
    # read them at every operation.

    def __post_init__(self):
        for field in ("layers", "kv_heads", "head_dim", "dtype_bytes"):
            value = getattr(self, field)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"ModelSpec {self.name!r}: {field} must be a positive int, got {value!r}")
        if self.kv_encoding not in KV_ENCODINGS:
            raise ValueError(f"ModelSpec {self.name!r}: kv_encoding must be one of "
                             f"{', '.join(KV_ENCODINGS)}, got {self.kv_encoding!r}")
        head_token_bytes(self.head_dim, self.dtype_bytes, self.kv_encoding)  # nvfp4's multiple of 16
        if self.pages not in PAGES:
            raise ValueError(f"ModelSpec {self.name!r}: pages must be one of {', '.join(PAGES)}, "
                             f"got {self.pages!r}")
        if self.groups:
            seen = sorted(layer for g in self.groups for layer in g.layers)
            if seen != list(range(self.layers)):
                raise ValueError(f"ModelSpec {self.name!r}: the groups must hold every layer "
                                 f"0..{self.layers - 1} exactly once, got {seen}")
            if len({len(g.layers) for g in self.groups}) != 1:
                raise ValueError(f"ModelSpec {self.name!r}: groups must hold the same number of "
                                 f"layers (one pool of equal blocks serves them all), got "
                                 f"{[len(g.layers) for g in self.groups]}")
            if not any(g.per_token for g in self.groups):
                raise ValueError(f"ModelSpec {self.name!r}: a model of state groups only has no "
                                 f"token blocks to size its pages by")

    @functools.cached_property
    def kv_groups(self) -> tuple:
        """The groups, one full group of every layer for a model that names none."""
        return self.groups or (KVGroup(tuple(range(self.layers))),)

    @functools.cached_property
    def hybrid(self) -> bool:
        """More than one group, or any kind but full: what a backend must declare it runs."""
        return len(self.kv_groups) > 1 or any(g.family != "full" for g in self.kv_groups)

    @functools.cached_property
    def group_layers(self) -> int:
        """L_group: layers per group."""
        return self.layers // len(self.kv_groups)

    def group_slot_bytes(self, group: KVGroup) -> int:
        """Real bytes of one token of one group's layers: 2 * L_group * H_kv * (d_head bytes in
        the model's encoding) for attention, L_group * (d * s, or the layout's bytes) for mla(d);
        0 for a state group (its size is per sequence)."""
        n = len(group.layers)
        if group.state_bytes is not None:
            return 0
        if group.latent is not None:
            return n * (group.latent_bytes or group.latent * self.dtype_bytes)
        return 2 * n * self.kv_heads * head_token_bytes(self.head_dim, self.dtype_bytes, self.kv_encoding)

    def group_token_bytes(self, group: KVGroup) -> int:
        """Bytes of one token of one group: its slot's (one entry's) bytes / r, rounded up where
        r does not divide them (``kv_bytes`` counts whole entries exactly)."""
        return -(-self.group_slot_bytes(group) // group.ratio)

    @functools.cached_property
    def bytes_per_token(self) -> int:
        """Cache bytes of one token over every layer (the real bytes; state groups hold none; a
        compressed(r) group's are its entry's / r)."""
        return sum(self.group_token_bytes(g) for g in self.kv_groups)

    @functools.cached_property
    def slot_bytes(self) -> int:
        """Bytes of one token slot of the pool's page: the largest group's (2 * L_group * H_kv *
        d_head * s for groups of one shape); smaller groups' pages are padded to it."""
        return max(self.group_slot_bytes(g) for g in self.kv_groups)

    @functools.cached_property
    def kv_pair(self) -> int:
        """Vectors per token per layer in the K/V arrays: 2 (K and V), 1 for a model of mla(d)
        groups (one latent, stored as 1 "head" of width d: kv_heads 1, head_dim d)."""
        latents = {g.latent for g in self.kv_groups if g.per_token}
        if latents == {None}:
            return 2
        if None in latents or latents != {self.head_dim} or self.kv_heads != 1:
            raise ValueError(f"ModelSpec {self.name!r}: K/V arrays of an MLA model take every token "
                             f"group mla(d) with kv_heads 1 and head_dim d (got "
                             f"{', '.join(g.kind for g in self.kv_groups)}, kv_heads {self.kv_heads}, "
                             f"head_dim {self.head_dim}); a model mixing them has formulas only")
        return 1

    @functools.cached_property
    def kv_shape(self) -> tuple:
        """One token's K/V over every layer: (2, L, H_kv, d_head), or (1, L, 1, d) for MLA."""
        return (self.kv_pair, self.layers, self.kv_heads, self.head_dim)

    @functools.cached_property
    def slot_shape(self) -> tuple:
        """One token slot of one group's block: (2, L_group, H_kv, d_head), (1, L_group, 1, d)."""
        return (self.kv_pair, self.group_layers, self.kv_heads, self.head_dim)

    @functools.cached_property
    def state_bytes(self) -> int:
        """Bytes of the fixed states one live sequence holds over every state group."""
        return sum(len(g.layers) * g.state_bytes for g in self.kv_groups if g.state_bytes is not None)

    @functools.cached_property
    def tensor_scale_bytes(self) -> int:
        """The format's per-tensor metadata, held once: a float32 scale per attention layer for K
        and for V (fp8, nvfp4), 0 otherwise."""
        if self.kv_encoding not in ("fp8", "nvfp4"):
            return 0
        layers = sum(len(g.layers) for g in self.kv_groups if g.per_token and g.latent is None)
        return 2 * layers * SCALE_BYTES


def hybrid_groups(layers: int, pattern, per_group: int | None = None) -> tuple:
    """Groups of a model whose layer ``i`` has the kind ``pattern[i % len(pattern)]`` (None for
    full, W for sliding(W), or a kind as a trace header names it: "chunked(8192)"), as vLLM's
    hybrid allocator forms them: the layers of each kind, in order, cut into groups of
    ``per_group`` layers (default: the fewest layers of any kind). Kinds in order of first
    appearance; the groups of one kind in layer order."""
    kinds: dict = {}
    for i in range(layers):
        kinds.setdefault(pattern[i % len(pattern)], []).append(i)
    size = per_group or min(len(v) for v in kinds.values())
    out = []
    for kind, members in kinds.items():
        if len(members) % size:
            raise ValueError(f"{len(members)} layers of kind {kind!r} do not split into groups "
                             f"of {size}")
        fields = parse_kind(kind) if isinstance(kind, str) else {"window": kind}
        out += [KVGroup(tuple(members[k:k + size]), **fields) for k in range(0, len(members), size)]
    return tuple(out)


_KIND_ARGS = {"full": (), "sliding": ("window",), "chunked": ("chunk",), "sinks": ("S", "W"),
              "mla": ("latent",), "state": ("state_bytes",), "compressed": ("compress",)}
_KIND_UNITS = {"window": "a sliding window is at least 1 token", "chunk": "a chunk is at least 1 token",
               "S": "the sinks are at least 1 token", "W": "a sink model's window is at least 1 token",
               "latent": "a latent is at least 1 element wide", "state_bytes": "a state is at least 1 byte",
               "compress": "a compressed entry covers at least 1 token"}
_KIND = re.compile(r"\s*([a-z]+)\s*(?:\(([^()]*)\))?\s*")


def parse_kind(text: str) -> dict:
    """A group kind as a trace header names it -> its KVGroup fields: 'full' -> {};
    'sliding(4096)' -> {'window': 4096}; 'chunked(8192)'; 'sinks(4,1024)' -> {'sinks': (4, 1024)};
    'mla(576)'; 'state(1097728)' (bytes per layer); 'compressed(4)' -> {'compress': 4}. Every
    argument a positive int64."""
    known = "full, sliding(W), chunked(C), sinks(S,W), mla(d), state(bytes), compressed(r)"
    m = _KIND.fullmatch(str(text))
    if not m or m.group(1) not in _KIND_ARGS:
        raise ValueError(f"not a KV cache group kind: {text!r} ({known})")
    name, names = m.group(1), _KIND_ARGS[m.group(1)]
    args = [] if m.group(2) is None else [a.strip() for a in m.group(2).split(",")]
    if len(args) != len(names) or not all(re.fullmatch(r"\d+", a) for a in args):
        want = f"{name}({', '.join(names)})" if names else name
        raise ValueError(f"not a KV cache group kind: {text!r} ({want} takes "
                         f"{len(names) or 'no'} integer argument(s); the kinds: {known})")
    values = [int(a) for a in args]
    most = int(np.iinfo(np.int64).max)  # token counts and bytes are int64 (the trace's, a pool's)
    for arg, v in zip(names, values):
        if v < 1:
            raise ValueError(f"{text!r}: {_KIND_UNITS[arg]}")
        if v > most:
            raise ValueError(f"{text!r}: {arg} = {v} is outside int64 (at most {most:,})")
    if name == "sinks":
        return {"sinks": tuple(values)}
    return dict(zip(names, values))


def with_group_kinds(model: ModelSpec, kinds) -> ModelSpec:
    """``model`` with its layers re-shaped into groups of the given kinds (layer i in group
    i mod G): what a trace header's ``groups`` asks for. The same model when they already match."""
    fields = [parse_kind(k) for k in kinds]
    if [g.kind for g in model.kv_groups] == [KVGroup((), **f).kind for f in fields]:
        return model
    if not fields or model.layers % len(fields):
        raise ValueError(f"model {model.name!r}: {model.layers} layers do not split into "
                         f"{len(fields)} groups {list(kinds)}")
    groups = tuple(KVGroup(tuple(range(g, model.layers, len(fields))), **f)
                   for g, f in enumerate(fields))
    return dataclasses.replace(model, groups=groups)


# 2026 models (SPEC §12), each from its public config.json (field = value), bf16 unless named.
MODELS_2026 = (
    # deepseek-ai/DeepSeek-V3: num_hidden_layers = 61, kv_lora_rank = 512, qk_rope_head_dim = 64,
    # num_attention_heads = 128: one latent of 512 + 64 = 576 per token per layer, shared by the
    # heads. kv_heads / head_dim are unused by an mla group (set to 1 and the latent width).
    ModelSpec("deepseek-v3", layers=61, kv_heads=1, head_dim=576,
              groups=(KVGroup(tuple(range(61)), latent=576),)),
    # The same in vLLM's fp8 MLA layout: 512 fp8 codes + 4 float32 scales + 64 bf16 rope values
    # = 512 + 16 + 128 = 656 bytes per token per layer.
    ModelSpec("deepseek-v3-fp8", layers=61, kv_heads=1, head_dim=576,
              groups=(KVGroup(tuple(range(61)), latent=576, latent_bytes=656),)),
    # moonshotai/Kimi-K2-Instruct: num_hidden_layers = 61, kv_lora_rank = 512,
    # qk_rope_head_dim = 64 (num_attention_heads = 64): DeepSeek-V3's latent.
    ModelSpec("kimi-k2", layers=61, kv_heads=1, head_dim=576,
              groups=(KVGroup(tuple(range(61)), latent=576),)),
    # meta-llama/Llama-4-Scout-17B-16E: num_hidden_layers = 48, num_key_value_heads = 8,
    # head_dim = 128, attention_chunk_size = 8192, no_rope_layer_interval = 4: layers 3, 7, ...
    # (every 4th) are global, the other 3 of 4 chunked: 3 chunked groups of 12 and 1 full.
    ModelSpec("llama-4-scout", layers=48, kv_heads=8, head_dim=128,
              groups=hybrid_groups(48, ("chunked(8192)",) * 3 + (None,))),
    # openai/gpt-oss-20b: num_hidden_layers = 24, num_key_value_heads = 8, head_dim = 64,
    # sliding_window = 128, layer_types alternating sliding_attention / full_attention.
    # Its "sinks" are a learned logit per head in the softmax, not cached tokens: no KV bytes,
    # so the cache is sliding(128) beside full (as vLLM's SlidingWindowSpec runs it).
    ModelSpec("gpt-oss-20b", layers=24, kv_heads=8, head_dim=64,
              groups=hybrid_groups(24, (128, None))),
    # openai/gpt-oss-120b: num_hidden_layers = 36, the rest as gpt-oss-20b.
    ModelSpec("gpt-oss-120b", layers=36, kv_heads=8, head_dim=64,
              groups=hybrid_groups(36, (128, None))),
    # Qwen/Qwen3-Next-80B-A3B-Instruct: num_hidden_layers = 48, full_attention_interval = 4
    # (layers 3, 7, ... full), num_key_value_heads = 2, head_dim = 256; the 36 Gated DeltaNet
    # layers: linear_num_key_heads = 16, linear_num_value_heads = 32, linear_key_head_dim =
    # linear_value_head_dim = 128, linear_conv_kernel_dim = 4. State per layer, bf16 (vLLM's
    # mamba cache dtype "auto"): recurrent 32 * 128 * 128 = 524,288 + conv (4 - 1) *
    # (2 * 16 * 128 + 32 * 128) = 24,576 elements, * 2 bytes = 1,097,728 bytes.
    ModelSpec("qwen3-next-80b-a3b", layers=48, kv_heads=2, head_dim=256,
              groups=hybrid_groups(48, ("state(1097728)",) * 3 + (None,))),
    # ai21labs/Jamba-v0.1: num_hidden_layers = 32, attn_layer_period = 8, attn_layer_offset = 4
    # (layers 4, 12, 20, 28 attend), num_key_value_heads = 8, hidden_size 4096 / 32 heads = 128
    # per head; Mamba layers: mamba_expand = 2 (d_inner 8192), mamba_d_state = 16,
    # mamba_d_conv = 4. State per layer, bf16: ssm 8192 * 16 = 131,072 + conv 8192 * 3 = 24,576
    # elements, * 2 bytes = 311,296 bytes. 7 state groups of 4 layers and 1 full.
    ModelSpec("jamba-v0.1", layers=32, kv_heads=8, head_dim=128,
              groups=hybrid_groups(32, ("state(311296)",) * 4 + (None,) + ("state(311296)",) * 3)),
    # Llama-3-8B's cache in fp8 (per-tensor scales), fp8 with a scale per token per head, NVFP4.
    ModelSpec("llama-3-8b-fp8", layers=32, kv_heads=8, head_dim=128, kv_encoding="fp8"),
    ModelSpec("llama-3-8b-fp8-token-head", layers=32, kv_heads=8, head_dim=128,
              kv_encoding="fp8-per-token-head"),
    ModelSpec("llama-3-8b-nvfp4", layers=32, kv_heads=8, head_dim=128, kv_encoding="nvfp4"),
)

# Public model configs (config.json: num_hidden_layers, num_key_value_heads, head_dim), fp16.
PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("tiny", layers=2, kv_heads=2, head_dim=8),
        ModelSpec("llama-2-7b", layers=32, kv_heads=32, head_dim=128),
        ModelSpec("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
        ModelSpec("llama-2-70b", layers=80, kv_heads=8, head_dim=128),
        ModelSpec("mistral-7b", layers=32, kv_heads=8, head_dim=128),
        ModelSpec("qwen2.5-7b", layers=28, kv_heads=4, head_dim=128),
        # The PagedAttention paper's model: 40 layers, 40 heads of 128, 800 KiB per token.
        ModelSpec("opt-13b", layers=40, kv_heads=40, head_dim=128),
        # Hybrid models (SPEC §8). Gemma 2: layer i slides (W = 4096) when i is even, else full:
        # two groups of 21. Gemma 3 (google/gemma-3-12b: num_hidden_layers = 48,
        # num_key_value_heads = 8, head_dim = 256, sliding_window = 1024, sliding_window_pattern
        # = 6): every 6th layer full, the rest slide: vLLM makes 6 groups of 8 layers (5 sliding,
        # 1 full). Mistral-7B v0.1: W = 4096 on every layer.
        ModelSpec("gemma-2-9b", layers=42, kv_heads=8, head_dim=256,
                  groups=hybrid_groups(42, (4096, None))),
        ModelSpec("gemma-3-12b", layers=48, kv_heads=8, head_dim=256,
                  groups=hybrid_groups(48, (1024,) * 5 + (None,), per_group=8)),
        ModelSpec("mistral-7b-v0.1", layers=32, kv_heads=8, head_dim=128,
                  groups=hybrid_groups(32, (4096,))),
        # Full-attention twins of the same size, for the capacity comparison.
        ModelSpec("gemma-2-9b-full", layers=42, kv_heads=8, head_dim=256),
        ModelSpec("gemma-3-12b-full", layers=48, kv_heads=8, head_dim=256),
        # Two groups of two layers, sliding(32) on the even layers: windows of 2-3 blocks of 16.
        ModelSpec("tiny-hybrid", layers=4, kv_heads=2, head_dim=8,
                  groups=hybrid_groups(4, (32, None))),
        # Test models of SPEC §12's kinds: Llama-4's pattern in 4 layers (chunked(32) on 3 of
        # 4, groups of one layer); sinks(8, 24) beside full, two groups of two layers.
        ModelSpec("tiny-chunked", layers=4, kv_heads=2, head_dim=8,
                  groups=hybrid_groups(4, ("chunked(32)",) * 3 + (None,))),
        ModelSpec("tiny-sinks", layers=4, kv_heads=2, head_dim=8,
                  groups=hybrid_groups(4, ("sinks(8,24)", None))),
        # DeepSeek-V4's pattern in 2 layers (full beside compressed KV, compress_ratio 4): one
        # full layer and one compressed(4), one entry of 2 * 2 * 8 * 2 = 64 bytes per 4 tokens.
        ModelSpec("tiny-compressed", layers=2, kv_heads=2, head_dim=8,
                  groups=hybrid_groups(2, (None, "compressed(4)"))),
        # MLA in 2 layers, one group: a latent of 12 per token per layer, 2 * 12 * 2 = 48 bytes.
        ModelSpec("tiny-mla", layers=2, kv_heads=1, head_dim=12,
                  groups=(KVGroup((0, 1), latent=12),)),
        # A Mamba hybrid in 4 layers (Qwen3-Next's 3:1, groups of one layer): state(512) on 3
        # of 4, one full layer; at block size 8 a state fills one block of 8 * 2 * 2 * 8 * 2
        # = 512 bytes.
        ModelSpec("tiny-mamba", layers=4, kv_heads=2, head_dim=8,
                  groups=hybrid_groups(4, ("state(512)",) * 3 + (None,))),
        # tiny in SPEC §12's float formats: fp8 (e4m3) with per-tensor scales, fp8 with a scale
        # per token per head, NVFP4 (head_dim 16: one e4m3 scale per 16 elements).
        ModelSpec("tiny-fp8", layers=2, kv_heads=2, head_dim=8, kv_encoding="fp8"),
        ModelSpec("tiny-fp8-token-head", layers=2, kv_heads=2, head_dim=8,
                  kv_encoding="fp8-per-token-head"),
        ModelSpec("tiny-nvfp4", layers=2, kv_heads=2, head_dim=16, kv_encoding="nvfp4"),
        *MODELS_2026,
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """2 (K and V) * L * H_kv * d_head * s."""
    return 2 * layers * kv_heads * head_dim * dtype_bytes


def kv_bytes(tokens: int, model: ModelSpec) -> int:
    """M_KV(T) = T * bytes_per_token; a compressed(r) group holds ceil(T/r) entries of its slot
    bytes."""
    if all(g.ratio == 1 for g in model.kv_groups):
        return tokens * model.bytes_per_token
    return sum(entries(tokens, g) * model.group_slot_bytes(g) for g in model.kv_groups)


def entries(tokens: int, group: KVGroup) -> int:
    """ceil(T/r): the slots a group writes for T tokens (T but for compressed(r))."""
    return blocks_needed(tokens, group.ratio)


def key_tokens(group: KVGroup, block_size: int) -> int:
    """B * r: the tokens one block of the group covers, so the granularity of its prefix-cache
    keys (SPEC §12: lookup and store key a compressed group's blocks by the same B * r)."""
    return block_size * group.ratio


def block_bytes(block_size: int, model: ModelSpec) -> int:
    """B * 2 * L_group * H_kv * d_head * s: one block holds one group's layers (every layer for
    a model of one group)."""
    return block_size * model.slot_bytes


def blocks_needed(tokens: int, block_size: int) -> int:
    """ceil(T / B), 0 for T <= 0. Integer arithmetic: no float rounding at large T."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if tokens <= 0:
        return 0
    return -(-tokens // block_size)


def tail_waste(tokens: int, block_size: int) -> int:
    """Free slots in the last block: (B - T mod B) mod B."""
    return (block_size - tokens % block_size) % block_size


def append_new_blocks(delta_tokens: int, free_in_last: int, block_size: int) -> int:
    """ceil(max(0, dT - f_last) / B): new blocks an append takes after filling the tail."""
    return blocks_needed(max(0, delta_tokens - free_in_last), block_size)


def fragmentation(free_slots: int, capacity_slots: int) -> float:
    """sum(free_slots) / sum(capacity) over physical blocks in use; 0.0 when none is in use."""
    if capacity_slots == 0:
        return 0.0
    return free_slots / capacity_slots


def tail_reservation(tail_free, remaining):
    """Slots of a sequence's private tail block that its later tokens will fill:
    ``min(free slots of the tail, max(0, final_tokens - tokens))``. Python ints, NumPy arrays or
    torch tensors (on their own device) alike, so that every backend states it once."""
    if isinstance(tail_free, int) and isinstance(remaining, int):
        return min(tail_free, max(0, remaining))
    if hasattr(remaining, "clamp"):  # a torch tensor
        return remaining.clamp(min=0).minimum(tail_free)
    return np.minimum(tail_free, np.maximum(remaining, 0))


def slab_reservation(slab_slots: int, final_tokens: int, held_tokens: int) -> int:
    """Slots of a contiguous slab that later tokens of its sequence will fill: up to the slab's
    end or the sequence's final length, whichever comes first."""
    return min(slab_slots, final_tokens) - held_tokens


def sharing_saving(prefix_tokens: int, branches: int, model: ModelSpec, block_size: int) -> int:
    """Bytes saved by k branches sharing a T_p-token prefix: (k - 1) * M_KV of whole shared blocks.

    Only whole blocks stay shared: the partial tail block is copied at the first write of all
    but one branch.
    """
    whole = (prefix_tokens // block_size) * block_size
    return (branches - 1) * kv_bytes(whole, model)


def jain_index(values) -> float:
    """Jain's fairness index (sum x)^2 / (n * sum x^2); 1.0 for an empty or all-zero list."""
    xs = [Fraction(v) if not isinstance(v, float) else v for v in values]
    n = len(xs)
    sq = sum(x * x for x in xs)
    if n == 0 or sq == 0:
        return 1.0
    return float(sum(xs) ** 2 / (n * sq))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_UNIT = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'12GiB' -> 12 * 2**30; '1.5 GB' -> 1.5e9; '4096B' -> 4096. Bytes always name their unit:
    a plain number is a count of blocks wherever a budget is asked (budget_blocks), so it is no
    byte size here."""
    m = _SIZE.match(str(text))
    if not m:
        raise ValueError(f"not a byte size: {text!r} (try 512MiB, 12GiB, 4096B)")
    if m.group(2) is None:
        raise ValueError(f"not a byte size: {text!r}: bytes need a unit ({text.strip()}B, or KiB, "
                         f"MiB, GiB); a plain number is a count of blocks")
    unit = m.group(2).lower()
    return int(Fraction(m.group(1)) * _UNIT[unit])


def budget_blocks(budget: str | int, block_size: int, model: ModelSpec) -> int:
    """A budget given in blocks (an int, or '1024' / '1024 blocks') or in bytes ('12GiB').

    A byte budget holds floor(bytes / block_bytes) whole blocks.
    """
    if isinstance(budget, int):
        if budget < 0:
            raise ValueError(f"budget must be >= 0 blocks, got {budget}")
        return budget
    text = str(budget).strip()
    m = re.fullmatch(r"(\d+)\s*(blocks?)?", text, re.IGNORECASE)
    if m:
        return int(m.group(1))
    return parse_bytes(text) // block_bytes(block_size, model)


# --- sliding windows and capacity (SPEC §8) ------------------------------------------------

def window_start(tokens: int, window: int | None) -> int:
    """First position the next token attends to: max(0, T - W + 1); 0 for full attention."""
    return 0 if window is None else max(0, tokens - window + 1)


def first_held_block(tokens: int, window: int | None, block_size: int) -> int:
    """Index of the first block a group holds after an operation leaves ``tokens`` tokens: the
    blocks whose positions all lie below ``T - W + 1`` are released."""
    return window_start(tokens, window) // block_size


def group_blocks(tokens: int, window: int | None, block_size: int) -> int:
    """blocks_g(X): ceil(X/B) for a full group, min(ceil(X/B), ceil((W-1)/B) + 1) for a sliding
    one (the most blocks a window of W positions can intersect, whatever the alignment)."""
    full = blocks_needed(tokens, block_size)
    if window is None:
        return full
    return min(full, blocks_needed(window - 1, block_size) + 1)


def _at_least_0(x):
    """max(0, x) for a Python int, a NumPy array or a torch tensor."""
    if isinstance(x, int):
        return max(0, x)
    return x.clamp(min=0) if hasattr(x, "clamp") else np.maximum(x, 0)


def trailing_first_block(tokens, group: KVGroup, block_size: int):
    """First block of the trailing run a group holds at ``tokens`` tokens: ``max(0, T - W + 1)
    // B`` for sliding(W) and the window of sinks(S, W), ``floor(T/C) * C // B`` for chunked(C),
    ``(T - 1) // B`` for state (the block holding the state after the last token), 0 for the
    rest. Python ints, NumPy arrays or torch tensors of lengths alike (a sinks group also holds
    its first ``sink_blocks``)."""
    if group.state_bytes is not None:
        return _at_least_0(tokens - 1) // block_size
    if group.chunk is not None:
        return tokens // group.chunk * group.chunk // block_size
    window = group.window if group.window is not None else group.sinks[1] if group.sinks else None
    if window is None:
        return 0 * tokens
    return _at_least_0(tokens - window + 1) // block_size


def sink_blocks(group: KVGroup, block_size: int) -> int:
    """ceil(S/B): the blocks holding a sinks(S, W) group's first S tokens (0 for other kinds)."""
    return blocks_needed(group.sinks[0], block_size) if group.sinks is not None else 0


def released_blocks(tokens: int, group: KVGroup, block_size: int) -> range:
    """Block indices a group no longer holds once an operation leaves ``tokens`` tokens (SPEC §8,
    §12): below ``T - W + 1`` (sliding), below the current chunk ``floor(T/C)*C`` (chunked),
    between the sinks' blocks and the window's (sinks: blocks holding any of the first S tokens
    are kept), below the last token's block (state: the states at earlier block boundaries,
    cached where their blocks are hashed); none for full and mla groups."""
    kept = sink_blocks(group, block_size)
    return range(kept, max(kept, trailing_first_block(tokens, group, block_size)))


def held_blocks(tokens: int, group: KVGroup, block_size: int) -> list:
    """Block indices a group holds (or, for a prefix hit of ``tokens``, needs cached) at
    ``tokens`` tokens: every block of ``ceil(ceil(T/r)/B)`` (r = 1 but for compressed(r)) but
    the released ones."""
    gone = released_blocks(tokens, group, block_size)
    return [i for i in range(blocks_needed(entries(tokens, group), block_size)) if i not in gone]


def state_blocks(group: KVGroup, block_bytes: int) -> int:
    """ceil(L_group * state bytes / block_bytes): the blocks one sequence's state takes."""
    return blocks_needed(len(group.layers) * group.state_bytes, block_bytes)


def one_block_states(pool: str, model: ModelSpec, block_size: int) -> list:
    """Indices of the model's state groups, for a pool that keeps each state in the block of its
    sequence's last token (as vLLM pads its pages so that one state fits one block); a state
    larger than a block is refused, naming the block size that would hold it."""
    bb = block_bytes(block_size, model)
    out = []
    for g, group in enumerate(model.kv_groups):
        if group.state_bytes is None:
            continue
        if state_blocks(group, bb) > 1:
            need = -(-len(group.layers) * group.state_bytes // model.slot_bytes)
            raise ValueError(f"{pool}: the state of a {group.kind} group of {len(group.layers)} "
                             f"layer(s) takes {state_blocks(group, bb)} blocks of {bb} bytes; it "
                             f"keeps a state in one block (block_size >= {need} for model "
                             f"{model.name})")
        out.append(g)
    return out


def kind_blocks(tokens: int, group: KVGroup, block_size: int, block_bytes: int) -> int:
    """blocks_g(X) of any kind: the most blocks a request of X tokens holds in the group.
    full, mla: ceil(X/B); sliding: min(ceil(X/B), ceil((W-1)/B) + 1); chunked: min(ceil(X/B),
    ceil((C-1)/B) + 1), or ceil((C-1)/B) when B divides C (a chunk then starts on a block edge);
    sinks: min(ceil(X/B), ceil(S/B) + ceil((W-1)/B) + 1); state: its state's blocks, at any X;
    compressed(r): ceil(ceil(X/r)/B)."""
    full = blocks_needed(entries(tokens, group), block_size)
    if group.state_bytes is not None:
        return state_blocks(group, block_bytes) if tokens > 0 else 0
    if group.chunk is not None:
        C = group.chunk
        return min(full, blocks_needed(C - 1, block_size) + (0 if C % block_size == 0 else 1))
    if group.sinks is not None:
        S, W = group.sinks
        return min(full, blocks_needed(S, block_size) + group_blocks(tokens, W, block_size))
    if group.compress is not None:
        return full
    return group_blocks(tokens, group.window, block_size)


def request_blocks(tokens: int, model: ModelSpec, block_size: int) -> int:
    """sum_g blocks_g(X): the blocks a request of X tokens holds over every group."""
    bb = block_bytes(block_size, model)
    return sum(kind_blocks(tokens, g, block_size, bb) for g in model.kv_groups)


def request_bytes(tokens: int, model: ModelSpec, block_size: int) -> int:
    """Bytes a request of X tokens holds: its blocks at the padded page size (``pages =
    "padded"``), or each group's blocks at its own page size (``"pools"``; a state group's
    pages are its state's bytes)."""
    if model.pages == "padded":
        return request_blocks(tokens, model, block_size) * block_bytes(block_size, model)
    bb = block_bytes(block_size, model)
    return sum(kind_blocks(tokens, g, block_size, bb) * block_size * model.group_slot_bytes(g)
               if g.per_token else (len(g.layers) * g.state_bytes if tokens > 0 else 0)
               for g in model.kv_groups)


def budget_concurrency(budget_bytes: int, tokens: int, model: ModelSpec, block_size: int) -> int:
    """Requests of X tokens that fit in a byte budget, the format's per-tensor metadata taken
    first: floor((budget - metadata) / request_bytes(X)). With padded pages this is
    floor(num_blocks / sum_g blocks_g(X)) over the budget's whole blocks."""
    need = request_bytes(tokens, model, block_size)
    return max(0, budget_bytes - model.tensor_scale_bytes) // need if need else 0


def padding_bytes(block_size: int, model: ModelSpec, group: KVGroup) -> int:
    """Bytes of one of the group's pages lost to padding it to the pool's page (0 with one pool
    per page size, or for the largest group): block_bytes - B * the group's real slot bytes.
    A state group's padding is that of its last block: state_blocks * block_bytes - state."""
    if model.pages == "pools":
        return 0
    bb = block_bytes(block_size, model)
    if not group.per_token:
        return state_blocks(group, bb) * bb - len(group.layers) * group.state_bytes
    return bb - block_size * model.group_slot_bytes(group)


def max_concurrency(num_blocks: int, tokens: int, model: ModelSpec, block_size: int) -> int:
    """floor(num_blocks / sum_g blocks_g(X)): requests of X tokens that fit at once."""
    need = request_blocks(tokens, model, block_size)
    return num_blocks // need if need else 0


def full_attention_twin(model: ModelSpec) -> ModelSpec:
    """The same layers as one full-attention group (what the model costs without its windows)."""
    return dataclasses.replace(model, name=f"{model.name} as full attention", groups=())


def capacity(model: ModelSpec, num_blocks: int, block_size: int, lengths) -> list[dict]:
    """SPEC §8's capacity at each request length X: blocks per request (sum_g blocks_g(X)), the
    largest concurrency floor(num_blocks / that), tokens that fit (concurrency * X); beside them
    the full-attention twin's in the same bytes (its blocks hold every layer: num_blocks // G of
    them)."""
    twin = full_attention_twin(model)
    twin_blocks = num_blocks * block_bytes(block_size, model) // block_bytes(block_size, twin)
    rows = []
    for x in lengths:
        need, twin_need = request_blocks(x, model, block_size), request_blocks(x, twin, block_size)
        c, tc = max_concurrency(num_blocks, x, model, block_size), max_concurrency(twin_blocks, x, twin, block_size)
        rows.append({"length": x, "blocks_per_request": need, "max_concurrency": c, "tokens_fit": c * x,
                     "full_blocks_per_request": twin_need, "full_max_concurrency": tc,
                     "full_tokens_fit": tc * x})
    return rows


def kinds_summary(model: ModelSpec) -> str:
    """The model's groups, runs of one kind counted: '3x chunked(8192) + full'."""
    runs: dict = {}
    for g in model.kv_groups:
        runs[g.kind] = runs.get(g.kind, 0) + 1
    return " + ".join(k if n == 1 else f"{n}x {k}" for k, n in runs.items())


def model_capacity(model: ModelSpec, budget_bytes: int, block_size: int, lengths) -> dict:
    """One row of `kvbench list-models`: the model's kinds and encoding, real bytes per token,
    the pool's block bytes and the padding per block over its groups, state bytes per sequence and
    the padding of their last blocks,
    and the largest concurrency at each length (``budget_concurrency``)."""
    row = {"model": model.name, "kinds": kinds_summary(model), "encoding": model.kv_encoding,
           "bytes_per_token": model.bytes_per_token, "block_bytes": block_bytes(block_size, model),
           "padding_per_block": sum(padding_bytes(block_size, model, g) for g in model.kv_groups
                                    if g.per_token),
           "state_bytes": model.state_bytes,
           "state_padding": sum(padding_bytes(block_size, model, g) for g in model.kv_groups
                                if not g.per_token)}
    for x in lengths:
        row[f"max_at_{x // 1024}k" if x % 1024 == 0 else f"max_at_{x}"] = \
            budget_concurrency(budget_bytes, x, model, block_size)
    return row


def capacity_lengths(model: ModelSpec) -> list[int]:
    """Lengths worth a capacity report: 1, 2, 4 and 8 times the largest window."""
    w = max(g.window for g in model.kv_groups if g.window is not None)
    return [w * k for k in (1, 2, 4, 8)]


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


__all__ = [
    "KVGroup", "hybrid_groups", "parse_kind", "with_group_kinds", "window_start", "entries", "key_tokens",
    "first_held_block", "group_blocks", "request_blocks", "released_blocks", "held_blocks",
    "state_blocks", "one_block_states", "kind_blocks", "trailing_first_block", "sink_blocks", "request_bytes", "budget_concurrency", "padding_bytes",
    "head_token_bytes", "kinds_summary", "model_capacity", "KV_ENCODINGS", "PAGES", "MODELS_2026", "max_concurrency", "capacity",
    "capacity_lengths", "full_attention_twin",
    "ModelSpec", "PRESETS", "get_model", "bytes_per_token", "kv_bytes", "block_bytes",
    "blocks_needed", "tail_waste", "append_new_blocks", "fragmentation", "sharing_saving",
    "jain_index", "parse_bytes", "budget_blocks", "ceil_div", "next_pow2",
]
