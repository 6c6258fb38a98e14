"""Workloads of tiers and transfers (SPEC §11): multi-turn conversations whose earlier turns are
stored down between turns and loaded back; agents reloading a shared prefix; and races, other
operations between a transfer's begin and its completion (:func:`tier_races`).

Each turn of a conversation is a new sequence: the first a prefill, the later ones a load of the
whole history so far plus a few new blocks; a short decode; a store of its full blocks (to
``host`` on even turns, ``disk`` on odd ones) that completes only after the next conversation
has taken its blocks (so the leased source blocks are still in use when their sequence is
freed); then the free. After each round an unhashed prefill takes every free block (the device
forgets its cached prefixes, so the next round loads from the tiers), and is freed. Conversations
0 and 3 share their block hashes under salts "a" and "b" (a tier must keep them apart). In the
last round a reader holds conversation 0's first block while its turn loads the rest after it
(a device hit beside a load); one store fails; one load is aborted before it completes.
"""
from __future__ import annotations

import random

from kvbench.traces.format import Append, Free, Header, Prefill, Trace, validate
from kvbench.traces.tier_ops import Abort, Done, Load, Store, TierSpec

SALTS = ("a", "b", "a", "b")  # conversation 3 has conversation 0's hashes under another salt


class _Ops:
    """Operations in order, with the sequence and transfer ids they take."""

    def __init__(self):
        self.ops, self.next_seq, self.next_id = [], 0, 0

    def seq(self) -> int:
        self.next_seq += 1
        return self.next_seq - 1

    def tid(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def add(self, op) -> None:
        self.ops.append(op)

    @property
    def step(self) -> int:
        return len(self.ops)


def tiered_turns(seed: int = 0, *, conversations: int = 4, turns: int = 3, new_blocks=(1, 2),
                 output=(1, 12), block_size: int = 8, num_blocks: int = 40, host: int = 8,
                 disk: int = 32) -> Trace:
    if conversations < 4 or turns < 2:
        raise ValueError("tiered_turns: at least 4 conversations (0 and 3 share hashes) and 2 turns")
    rng = random.Random(seed)
    B = block_size
    tiers = (TierSpec("host", host), TierSpec("disk", disk))
    b = _Ops()
    history = [[] for _ in range(conversations)]
    pending = None  # (store id, ok): completed after the next conversation's blocks are taken
    failing = (1, 1)  # (conversation, turn) whose store fails
    aborted = (2, turns - 1)  # whose load is aborted
    for t in range(turns):
        last = t == turns - 1
        for c in range(conversations):
            grow = rng.randint(*new_blocks)
            hashes = list(history[0]) if c == 3 else \
                history[c] + [1000 * (c + 1) + len(history[c]) + i for i in range(grow)]
            tokens = len(hashes) * B + rng.randint(1, B - 1)
            name, salt = f"c{c}", SALTS[c % len(SALTS)]
            reader = None
            if last and c == 0 and history[0]:  # a reader shares block 0 with the load
                reader = b.seq()
                b.add(Prefill(b.step, reader, name, B + 1, tuple(history[0][:1]), salt))
            seq = b.seq()
            if t == 0 and c != 3:
                b.add(Prefill(b.step, seq, name, tokens, tuple(hashes), salt))
                tid = None
            else:
                tid = b.tid()
                b.add(Load(b.step, seq, name, tokens, tuple(hashes), salt, id=tid))
            if pending is not None:
                b.add(Done(b.step, *pending))
                pending = None
            if (c, t) == aborted:
                b.add(Abort(b.step, seq))
                continue
            if tid is not None:
                b.add(Done(b.step, tid, True))
            if reader is not None:
                b.add(Free(b.step, reader))
            b.add(Append(b.step, (seq,), (rng.randint(*output),)))
            sid = b.tid()
            b.add(Store(b.step, sid, seq, "host" if t % 2 == 0 else "disk"))
            b.add(Free(b.step, seq))
            pending = (sid, (c, t) != failing)
            history[c] = hashes
        if pending is not None:
            b.add(Done(b.step, *pending))
            pending = None
        if not last:  # the device forgets its cached prefixes: each turn ends with every block free
            s = b.seq()
            b.add(Prefill(b.step, s, "flush", num_blocks * B))
            b.add(Free(b.step, s))
    params = {"conversations": conversations, "turns": turns, "new_blocks": list(new_blocks),
              "output": list(output), "block_size": B, "num_blocks": num_blocks, "host": host,
              "disk": disk}
    header = Header("tiered_turns", "kvbench.generators.tiered_turns v1", params, seed,
                    settings={"block_size": B, "num_blocks": num_blocks, "prefix_caching": True},
                    tiers=tiers)
    return validate(Trace(header, b.ops, name="tiered_turns"))




def agentic_prefix(seed: int = 0, *, agents: int = 2, rounds: int = 8, prefix: int = 6,
                   new_blocks=(1, 2), output=(1, 6), block_size: int = 8, num_blocks: int = 48,
                   host: int = 8, disk: int = 32) -> Trace:
    """Agents sharing one long prefix (a system prompt and its tools: ``prefix`` blocks), each
    round loading it back with their own history after the device has forgotten everything.

    The prefix is computed once and stored to host and disk. Each round: a flush (an unhashed
    prefill of every block, freed: the device keeps no cached prefix), then every agent loads the
    prefix, its own earlier rounds and a few new blocks, all loads begun before any completes
    (so the prefix's tier blocks are read by several loads at once, and a store begun between
    the completions must not evict them); then each agent decodes a little, stores its new full
    blocks to host (and, on odd rounds, to disk), and is freed. Host holds fewer blocks than the
    prefix and the agents' stores together, so the prefix is reloaded from host and from disk.
    """
    if agents < 2 or rounds < 2 or prefix < 1:
        raise ValueError("agentic_prefix: at least 2 agents (their loads overlap), 2 rounds, 1 prefix block")
    rng = random.Random(seed)
    B = block_size
    tiers = (TierSpec("host", host), TierSpec("disk", disk))
    b = _Ops()
    shared = tuple(range(100, 100 + prefix))
    boot = b.seq()
    b.add(Prefill(b.step, boot, "tools", prefix * B + 1, shared))
    for tier in ("disk", "host"):
        tid = b.tid()
        b.add(Store(b.step, tid, boot, tier))
        b.add(Done(b.step, tid, True))
    b.add(Free(b.step, boot))
    history = [[] for _ in range(agents)]
    for r in range(rounds):
        s = b.seq()
        b.add(Prefill(b.step, s, "flush", num_blocks * B))
        b.add(Free(b.step, s))
        calls = []
        for a in range(agents):
            grow = rng.randint(*new_blocks)
            mine = history[a] + [1000 * (a + 1) + len(history[a]) + i for i in range(grow)]
            seq, tid = b.seq(), b.tid()
            tokens = (prefix + len(mine)) * B + rng.randint(1, B - 1)
            b.add(Load(b.step, seq, f"agent{a}", tokens, shared + tuple(mine), id=tid))
            calls.append((a, seq, tid, len(history[a]), mine))
        for a, seq, tid, old, mine in calls:
            b.add(Done(b.step, tid, True))
            b.add(Append(b.step, (seq,), (rng.randint(*output),)))
            new = tuple(range(prefix + old, prefix + len(mine)))  # its new blocks, by position
            for tier in ("host", "disk") if r % 2 else ("host",):
                sid = b.tid()
                b.add(Store(b.step, sid, seq, tier, new))
                b.add(Done(b.step, sid, True))
            b.add(Free(b.step, seq))
            history[a] = mine
    params = {"agents": agents, "rounds": rounds, "prefix": prefix, "new_blocks": list(new_blocks),
              "output": list(output), "block_size": B, "num_blocks": num_blocks, "host": host,
              "disk": disk}
    header = Header("agentic_prefix", "kvbench.generators.agentic_prefix v1", params, seed,
                    settings={"block_size": B, "num_blocks": num_blocks, "prefix_caching": True},
                    tiers=tiers)
    return validate(Trace(header, b.ops, name="agentic_prefix"))


RACES = ("free", "abort", "fail", "two stores", "reload")


def tier_races(seed: int = 0, *, rounds: int = 10, block_size: int = 8, num_blocks: int = 24,
               host: int = 8, disk: int = 16) -> Trace:
    """Operations between a transfer's begin and its completion on the blocks it moves (SPEC
    §11: the backend moves the bytes at any moment in between; the lease and the load's hold
    must make that moment not matter).

    Each round a request of 3 hashed blocks and 1 to ``block_size - 1`` tokens more (the only
    draws from the seed) is prefilled and a store of its blocks begins (to host on even rounds,
    disk on odd ones); then, by round (RACES, in turn):
    its sequence is freed; or aborted; or freed and its store fails; or freed with a second
    store of the same blocks to the other tier in flight, completed before the first; or freed
    with a load in flight (below). Before each store completes, a flush takes every device
    block the leases leave (an exact fit of ``num_blocks - 3`` blocks: the cached prefixes of
    earlier rounds are evicted, and any leased block handed out shows), and is freed. In the
    "reload" round, after the flush, a load of the round before's prompt (stored to both tiers,
    gone from the device) and a block more begins before the store completes and completes
    after it, and meanwhile a prefill of that prompt's first 2 blocks may not hit its targets.
    """
    if rounds < 1 or num_blocks < 12 or block_size < 2:
        raise ValueError("tier_races: at least 1 round, 12 device blocks (3 leased, a load of 5 "
                         "and a prefill of 3 beside them) and blocks of 2 tokens (a partial one)")
    B = block_size
    tiers = (TierSpec("host", host), TierSpec("disk", disk))
    b, rng = _Ops(), random.Random(seed)

    def partial() -> int:  # the tokens past a prompt's full blocks (the seed's one draw)
        return rng.randint(1, B - 1)

    for r in range(rounds):
        race = RACES[r % len(RACES)]
        hashes = tuple(f"r{r}.{j}" for j in range(3))
        seq = b.seq()
        b.add(Prefill(b.step, seq, "races", 3 * B + partial(), hashes))
        tier, other = ("host", "disk") if r % 2 == 0 else ("disk", "host")
        stores = [b.tid()]
        b.add(Store(b.step, stores[0], seq, tier))
        if race == "two stores":
            stores.append(b.tid())
            b.add(Store(b.step, stores[1], seq, other))
        b.add(Abort(b.step, seq) if race == "abort" else Free(b.step, seq))
        flush = b.seq()
        b.add(Prefill(b.step, flush, "flush", (num_blocks - 3) * B))
        b.add(Free(b.step, flush))
        held = []
        if race == "reload":  # the round before stored its prompt to both tiers
            held, lid = [b.seq(), b.seq()], b.tid()
            before = tuple(f"r{r - 1}.{j}" for j in range(3))
            b.add(Load(b.step, held[0], "races", 4 * B + partial(), before + (f"r{r}.x",), id=lid))
            b.add(Prefill(b.step, held[1], "races", 2 * B + partial(), before[:2]))
        for tid in reversed(stores):
            b.add(Done(b.step, tid, race != "fail"))
        if held:
            b.add(Done(b.step, lid, True))
            for s in held:
                b.add(Free(b.step, s))
    params = {"rounds": rounds, "block_size": B, "num_blocks": num_blocks, "host": host, "disk": disk}
    header = Header("tier_races", "kvbench.generators.tier_races v1", params, seed,
                    settings={"block_size": B, "num_blocks": num_blocks, "prefix_caching": True},
                    tiers=tiers)
    return validate(Trace(header, b.ops, name="tier_races"))


__all__ = ["tiered_turns", "agentic_prefix", "tier_races"]
