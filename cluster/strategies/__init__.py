"""Decoding strategies, registered by name. Importing this package registers all of them."""
from cluster.strategies import (  # noqa: F401  importing each strategy module registers it
    autoregressive,
    cs_drafting,
    mag,
    spec_cascades,
    specdec_pp,
    speculative,
    suffix,
)
from cluster.strategies.base import (
    REGISTRY,
    ModelCall,
    Option,
    Propose,
    ProposeAdaptive,
    Score,
    StepContext,
    Strategy,
    all_options,
    check_option_name,
    register,
    resolve_options,
)

__all__ = ["REGISTRY", "ModelCall", "Option", "Propose", "ProposeAdaptive", "Score", "StepContext", "Strategy", "all_options", "check_option_name", "register", "resolve_options"]
