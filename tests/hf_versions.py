"""What the installed transformers declares where its releases differ: the suite follows it.

Device images and users' machines carry other transformers releases than this repository's
CI (5.17 on the GPU machines, 5.24 here), and a test that hard-codes one release's plans fails
on the other for no fault of plait's.
"""

from __future__ import annotations


def declares_dispatched_experts() -> bool:
    """Whether MoE families declare their experts in the layout plait splits ('ep_dispatch_experts',
    later 5.x releases). Earlier 5.x releases declare 'ep_router' / 'moe_tp_experts', which
    plait refuses in one line rather than split (docs/moe.md)."""
    import transformers

    return "ep_dispatch_experts" in str(getattr(transformers.MixtralConfig(), "base_model_ep_plan", ""))


def older_moe_reason() -> str:
    import transformers

    return (f"transformers {transformers.__version__} declares MoE experts in the older layout "
            "('ep_router', 'moe_tp_experts'), which plait refuses before training (docs/moe.md)")
