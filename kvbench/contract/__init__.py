"""The contract: SPEC's formulas, the backend protocol, the registry of backends."""
