"""Verification from logits: the sampling parameters of each request, the truncated
distributions they define and the step that reads logits. Imports the families
below it, up to `_chain`."""
