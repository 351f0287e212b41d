"""Verification from logits: the sampling parameters of each request, the truncated
distributions they define, the step that reads logits, and the engines' token-major
layout."""
