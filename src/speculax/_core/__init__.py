"""What every family shares: the numerics of reading and summing rows, the checks at
trace time, the run-time failures (`RESULTS`) and the reductions over a vocabulary
that may be split over devices. Imports nothing else of speculax."""
