"""asv suite of kvbench (asv.conf.json at the repository root)."""
