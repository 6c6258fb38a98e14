"""The rule sets: SPEC's (spec.py) and each engine's declared differences from it (vllm.py,
sglang.py), one module each. A backend names its set (``Capabilities.rules``) and that set's
parameters (``Capabilities.rule_params``); ``rule_set`` builds it. A new engine's rules are one
new module here, registered in ``RULE_SETS``.
"""
from __future__ import annotations

from kvbench.model.rules.base import RuleSet
from kvbench.model.rules.sglang import SGLangRules
from kvbench.model.rules.spec import SpecRules
from kvbench.model.rules.vllm import VLLMRules

RULE_SETS: dict[str, type[RuleSet]] = {"spec": SpecRules, "vllm": VLLMRules, "sglang": SGLangRules}


def rule_set(capabilities) -> RuleSet:
    """The rule set a backend declares (Capabilities.rules and rule_params); a clear error for
    an unknown set or parameter."""
    name = capabilities.rules
    if name not in RULE_SETS:
        raise ValueError(f"unknown rule set {name!r}: one of {', '.join(RULE_SETS)}")
    return RULE_SETS[name](**dict(capabilities.rule_params))


__all__ = ["RULE_SETS", "RuleSet", "rule_set"]
