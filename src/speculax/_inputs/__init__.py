"""The inputs of a step: the integer-array type, the coercion and checks every step
starts with, the uniforms and keys, and the engines' layouts (token-major drafts,
tree formats) converted to speculax's. Imports only `_core`."""
