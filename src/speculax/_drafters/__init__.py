"""Drafters beside a draft model: prompt lookup, which needs no weights, and the
heads that read the target's features (Medusa, EAGLE-style)."""
