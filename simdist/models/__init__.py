"""Gradient sources: the seeded synthetic stream (`synthetic`) and the folded MoE block (`moe`)."""
