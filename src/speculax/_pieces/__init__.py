"""The pieces a step is assembled from: acceptance tests, prefix counts, residuals,
samplers, and the numbers of block verification they share. Imports only `_core` and
`_inputs`."""
