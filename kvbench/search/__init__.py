"""The search: looking for a trace that fails, and cutting it down. histories.py (random histories
over random settings), fuzz.py (`kvbench fuzz`: campaigns under the checker), edits.py (the edits
that keep a trace legal), shrink.py (`kvbench shrink`: a failing trace cut down) and reproduce.py
(a failure written down as a header and a pytest case). It imports checking, the model, the traces
and the contract; checking imports nothing of it (tests/test_architecture.py)."""
