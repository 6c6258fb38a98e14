"""The model: what a KV cache's ledger and block structures must be, from the formulas alone.

oracle.py (the operations, the ledger), pool.py (the paged blocks), arena.py (the contiguous
slabs), kinds.py (one class per group kind, by table), rules/ (SPEC's and each engine's rules),
eviction.py (the device's eviction policies), tiers.py, tier_policies.py and tiered.py (the
lower tiers of SPEC §11 beside the oracle). It
imports the contract, the traces and the quantized pools' formats only: never checking, a
backend or a command (tests/test_architecture.py).
"""
