"""The rule sets: SPEC's (spec.py) and each engine's declared differences from it (vllm.py,
sglang.py), one module each. A backend declares them through its Capabilities' flags; each
module's docstring names the flags it reads.
"""
