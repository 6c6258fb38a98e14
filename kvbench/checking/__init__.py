"""Checking: the oracle (a pure model of the formulas), the checker that replays a trace beside
it, and the suite runner behind `kvbench run` and `kvbench check`. Nothing here imports a backend."""
