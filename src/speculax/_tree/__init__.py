"""Trees: the tree step's interface, the sibling rules, recursive rejection sampling
and traversal verification. Imports the families below it, up to `_chain`."""
