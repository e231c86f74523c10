"""Mixture-of-experts layers: top-k routing, experts grouped by expert, the sparse MoE block."""
