"""The chain step: `SpeculativeStep`, its presets, the fused draw and the
diagnostics. Imports the families below it (`_core`, `_inputs`, `_pieces`)."""
