"""The model: what a KV cache's ledger and block structures must be, from the formulas alone
(docs/architecture.md names each module; tests/test_architecture.py holds what it imports)."""
